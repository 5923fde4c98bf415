"""Online least squares over a turn's legs: what a pull, a recompute and a prefill on
D alone cost, measured on the server's own turns (wire contract, pure).

A sidecar times every engine leg it runs and adds the observation to a
:class:`LinearFit`: the sums of a weighted least-squares problem (``Σ w x xᵀ``,
``Σ w x y``, ``Σ w y²``), never the observations, so a fit is a few dozen numbers
whatever the traffic, the report carries it, and the operator adds the fits of many
pods by adding their sums (the same problem over all their legs). :func:`solve`
turns sums into coefficients; :func:`predict` prices a leg with them.

Two fits, each a fixed list of features (names are the contract: :func:`check`
refuses a fit of another shape, so pods of two kvferry versions never add unlike
sums):

- :data:`PREFILL_LEG`: P's prefill leg, seconds from the request to P's answer,
  over ``one`` (1), ``pull`` (1 when P pulled a handle, else 0), ``pulledTokens``
  (the tokens P read from D) and ``computedTokens`` (the prompt tokens P computed:
  prompt less pulled). A pull of N history tokens beats recomputing them when
  ``pull + pulledTokens·N < computedTokens·N``: the break-even of
  :func:`break_even_tokens`. This is the engines' whole cost of each way as the
  turn sees it (P's request, queue, pull, tail), which NIXL's own counters are not:
  they miss the engine steps around a transfer and, on a throttled link, half the
  wire time (docs/performance.md, "Break-even").
- :data:`DECODE_LEG`: D's leg, seconds from the request to D until its first token
  (a streamed answer) or its whole answer (a non-streamed one, whose
  ``outputTokens`` then count every token generated), over ``one``, ``alone`` (1
  when D prefilled the prompt itself), ``aloneComputedTokens`` (the tokens D
  computed then: prompt less what D's prefix cache held), ``fetchedTokens`` (on the
  P path: the prompt tokens D read from P) and ``outputTokens``.

Weights: a leg's timing noise grows with its length (a loaded node stretches a long
leg more, in seconds, than a short one), so an observation of a prompt of ``t``
tokens weighs ``1 / (1 + t / WEIGHT_TOKENS)²``: the short legs, which pin the fixed
costs a break-even depends on, are not drowned by the long ones. The weight depends
on the prompt's size only, never on the measured seconds (that would bias the fit
towards fast legs).

:func:`solve` is least squares with the per-token and per-output-token coefficients
held at or above zero (a cost that falls with more work is noise, not a cost), exact
for these few features (every support is tried), and refuses what the data cannot
say: too few observations, a feature never seen, a singular design.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Annotated, Final

import msgspec

# A prompt of this many tokens weighs a quarter of a 0-token one (see above).
WEIGHT_TOKENS: Final = 512.0
# Observations per coefficient before a fit is believed.
MIN_OBSERVATIONS_PER_FEATURE: Final = 2
# Observations in which a feature must be non-zero before its coefficient is read.
MIN_NONZERO: Final = 3
# A pivot below this share of its diagonal after scaling: the design is singular.
_SINGULAR: Final = 1e-10
# A fit has a handful of features: a report naming more is refused at decode, before
# any sum is allocated for them.
MAX_FEATURES: Final = 16
MAX_FEATURE_NAME: Final = 64
# No leg costs this much per unit of anything (seconds): sums that say so were not
# made by legs.
MAX_COEFFICIENT_SECONDS: Final = 600.0
# Sums made by real legs hold Cauchy-Schwarz to rounding; past this, they were made up.
_SLACK: Final = 1e-6

ONE: Final = "one"
PULL: Final = "pull"
PULLED_TOKENS: Final = "pulledTokens"
COMPUTED_TOKENS: Final = "computedTokens"
ALONE: Final = "alone"
ALONE_COMPUTED_TOKENS: Final = "aloneComputedTokens"
FETCHED_TOKENS: Final = "fetchedTokens"
OUTPUT_TOKENS: Final = "outputTokens"


@dataclass(frozen=True)
class Shape:
    """A fit's features, and which coefficients are costs (held >= 0)."""

    name: str
    features: tuple[str, ...]
    nonnegative: frozenset[str]


PREFILL_LEG: Final = Shape(
    "prefillLeg",
    (ONE, PULL, PULLED_TOKENS, COMPUTED_TOKENS),
    frozenset({PULLED_TOKENS, COMPUTED_TOKENS}),
)
DECODE_LEG: Final = Shape(
    "decodeLeg",
    (ONE, ALONE, ALONE_COMPUTED_TOKENS, FETCHED_TOKENS, OUTPUT_TOKENS),
    frozenset({ALONE_COMPUTED_TOKENS, FETCHED_TOKENS, OUTPUT_TOKENS}),
)
SHAPES: Final = {PREFILL_LEG.name: PREFILL_LEG, DECODE_LEG.name: DECODE_LEG}


def _tri(k: int) -> int:
    return k * (k + 1) // 2


def _index(i: int, j: int, k: int) -> int:
    """Position of (i, j), i <= j, in the row-major upper triangle of a k x k matrix."""
    return i * k - i * (i - 1) // 2 + (j - i)


class LinearFit(msgspec.Struct, rename="camel", forbid_unknown_fields=False):
    """The sums of one fit (cumulative, as every counter of the report).

    ``xx``: the upper triangle of ``Σ w x xᵀ``, row by row; ``xy``: ``Σ w x y``;
    ``yy``: ``Σ w y²``; ``nonzero[i]``: observations whose feature i was not 0."""

    features: Annotated[
        list[Annotated[str, msgspec.Meta(max_length=MAX_FEATURE_NAME)]],
        msgspec.Meta(max_length=MAX_FEATURES),
    ]
    observations: int = 0
    weight: float = 0.0
    xx: list[float] = msgspec.field(default_factory=list)
    xy: list[float] = msgspec.field(default_factory=list)
    yy: float = 0.0
    nonzero: list[int] = msgspec.field(default_factory=list)

    def __post_init__(self) -> None:
        # On construction and on decode: a fit whose sums do not match its features
        # never exists (msgspec names the field in its ValidationError).
        k = len(self.features)
        if not self.xx and not self.xy and not self.nonzero:
            self.xx, self.xy, self.nonzero = [0.0] * _tri(k), [0.0] * k, [0] * k
        if len(self.xx) != _tri(k) or len(self.xy) != k or len(self.nonzero) != k:
            raise ValueError(f"a fit over {k} features needs {_tri(k)} xx, {k} xy and {k} nonzero")

    def copy(self) -> LinearFit:
        return LinearFit(
            list(self.features),
            self.observations,
            self.weight,
            list(self.xx),
            list(self.xy),
            self.yy,
            list(self.nonzero),
        )


def empty(shape: Shape) -> LinearFit:
    return LinearFit(list(shape.features))


def check(shape: Shape, fit: LinearFit) -> str | None:
    """Why ``fit`` is not a fit of ``shape`` that legs could have made (None: it is).
    Each leg weighs at most 1, sums of products obey Cauchy-Schwarz, no feature is
    non-zero in more legs than there are, and no legs means no sums: what a report
    claims past that was not measured."""
    name = shape.name
    if tuple(fit.features) != shape.features:
        return f"{name}.features must be {list(shape.features)}"
    values = [fit.weight, fit.yy, *fit.xx, *fit.xy]
    if not all(math.isfinite(v) for v in values):
        return f"{name} holds a number that is not finite"
    k = len(shape.features)
    diag = [fit.xx[_index(i, i, k)] for i in range(k)]
    if any(d < 0 for d in diag) or fit.yy < 0 or fit.weight < 0:
        return f"{name} holds a negative sum of squares"
    if fit.observations == 0 and (any(values) or any(fit.nonzero)):
        return f"{name} has sums but no legs"
    if fit.weight > fit.observations * (1 + _SLACK) or any(
        n > fit.observations for n in fit.nonzero
    ):
        return f"{name} weighs or counts more than its {fit.observations} legs"

    def bound(a: float, b: float) -> float:
        return a * b * (1 + _SLACK) + 1e-300

    # Products, not powers: a square past a float's range is inf here, not an error.
    for i in range(k):
        for j in range(i + 1, k):
            v = fit.xx[_index(i, j, k)]
            if v * v > bound(diag[i], diag[j]):
                return f"{name}.xx is not the sum of any legs' products"
    for i in range(k):
        if fit.xy[i] * fit.xy[i] > bound(diag[i], fit.yy):
            return f"{name}.xy[{i}] is more than its legs could sum to"
    return None


def weight_of(prompt_tokens: int) -> float:
    return 1.0 / (1.0 + max(0, prompt_tokens) / WEIGHT_TOKENS) ** 2


def observe(
    fit: LinearFit, shape: Shape, x: Mapping[str, float], seconds: float, prompt_tokens: int
) -> None:
    """Add one leg: ``x`` by feature name (missing ones are 0; ``one`` is set here)."""
    if not math.isfinite(seconds) or seconds < 0:
        return
    row = [1.0 if f == ONE else float(x.get(f, 0.0)) for f in shape.features]
    if not all(math.isfinite(v) and v >= 0 for v in row):
        return
    w = weight_of(prompt_tokens)
    k = len(row)
    fit.observations += 1
    fit.weight += w
    fit.yy += w * seconds * seconds
    for i in range(k):
        if row[i]:
            fit.nonzero[i] += 1
        fit.xy[i] += w * row[i] * seconds
        for j in range(i, k):
            fit.xx[_index(i, j, k)] += w * row[i] * row[j]


def merge(fits: Sequence[LinearFit], shape: Shape) -> LinearFit:
    """The fit over all their observations (every fit must be of ``shape``)."""
    out = empty(shape)
    for f in fits:
        out.observations += f.observations
        out.weight += f.weight
        out.yy += f.yy
        out.xx = [a + b for a, b in zip(out.xx, f.xx, strict=True)]
        out.xy = [a + b for a, b in zip(out.xy, f.xy, strict=True)]
        out.nonzero = [a + b for a, b in zip(out.nonzero, f.nonzero, strict=True)]
    return out


@dataclass(frozen=True)
class Solved:
    """Coefficients by feature name (seconds per unit of it), the weighted root mean
    squared residual (seconds), and the observations behind them."""

    coefficients: dict[str, float]
    rms_seconds: float
    observations: int


@dataclass(frozen=True)
class Unsolved:
    reason: str


def _solve_on(a: list[list[float]], b: list[float]) -> list[float] | None:
    """Gaussian elimination with partial pivoting on a Jacobi-scaled system (token
    counts and indicators differ by orders of magnitude); None when singular."""
    k = len(b)
    scale = [math.sqrt(a[i][i]) if a[i][i] > 0 else 1.0 for i in range(k)]
    m = [[a[i][j] / (scale[i] * scale[j]) for j in range(k)] + [b[i] / scale[i]] for i in range(k)]
    for col in range(k):
        pivot = max(range(col, k), key=lambda r: abs(m[r][col]))
        if abs(m[pivot][col]) < _SINGULAR:
            return None
        m[col], m[pivot] = m[pivot], m[col]
        for r in range(k):
            if r != col and m[r][col]:
                f = m[r][col] / m[col][col]
                m[r] = [x - f * y for x, y in zip(m[r], m[col], strict=True)]
    return [m[i][k] / m[i][i] / scale[i] for i in range(k)]


def solve(
    fit: LinearFit, shape: Shape, needed: Sequence[str] = (), min_nonzero: int = MIN_NONZERO
) -> Solved | Unsolved:
    """Least squares with ``shape.nonnegative`` coefficients >= 0 (see the module
    docstring). ``needed``: features the caller reads; each must have been non-zero
    in ``min_nonzero`` observations (a pull cost from two pulls is a guess)."""
    why = check(shape, fit)
    if why is not None:
        return Unsolved(why)
    k = len(shape.features)
    wanted = MIN_OBSERVATIONS_PER_FEATURE * k
    if fit.observations < wanted:
        return Unsolved(f"{fit.observations} legs measured, {wanted} needed")
    for name in needed:
        seen = fit.nonzero[shape.features.index(name)]
        if seen < min_nonzero:
            return Unsolved(f"{name} seen in {seen} legs, {min_nonzero} needed")
    full = [[fit.xx[_index(min(i, j), max(i, j), k)] for j in range(k)] for i in range(k)]
    # Features never seen carry no information: left out (coefficient 0).
    present = [i for i in range(k) if full[i][i] > 0]
    constrained = [i for i in present if shape.features[i] in shape.nonnegative]
    best: tuple[float, list[float]] | None = None
    for r in range(len(constrained) + 1):
        for dropped in itertools.combinations(constrained, r):
            support = [i for i in present if i not in dropped]
            if not support:
                continue
            sub = _solve_on(
                [[full[i][j] for j in support] for i in support], [fit.xy[i] for i in support]
            )
            if sub is None:
                continue
            beta = [0.0] * k
            for i, v in zip(support, sub, strict=True):
                beta[i] = v
            if any(beta[i] < 0 for i in constrained) or not all(map(math.isfinite, beta)):
                continue
            sse = (
                fit.yy
                - 2 * sum(beta[i] * fit.xy[i] for i in range(k))
                + sum(beta[i] * full[i][j] * beta[j] for i in range(k) for j in range(k))
            )
            if not math.isfinite(sse):
                continue
            if best is None or sse < best[0]:
                best = (sse, beta)
    if best is None:
        return Unsolved("the legs measured do not tell the costs apart (a singular design)")
    sse, beta = best
    rms = math.sqrt(max(0.0, sse) / fit.weight) if fit.weight > 0 else 0.0
    if not math.isfinite(rms) or any(abs(b) > MAX_COEFFICIENT_SECONDS for b in beta):
        return Unsolved("the legs give no plausible cost (seconds per unit out of bounds)")
    return Solved(dict(zip(shape.features, beta, strict=True)), rms, fit.observations)


def predict(solved: Solved, x: Mapping[str, float]) -> float:
    """Seconds of a leg with features ``x`` (``one`` is implied)."""
    c = solved.coefficients
    return c.get(ONE, 0.0) + sum(c.get(name, 0.0) * v for name, v in x.items() if name != ONE)


def break_even_tokens(solved: Solved) -> float | None:
    """From a :data:`PREFILL_LEG` fit: the shortest history whose pull beats recomputing
    it (0 when a pull's fixed cost is not positive); None when a pulled token does not
    cost less than a computed one (never pull)."""
    c = solved.coefficients
    saving = c[COMPUTED_TOKENS] - c[PULLED_TOKENS]
    if saving <= 0:
        return None
    tokens = max(0.0, c[PULL]) / saving
    return tokens if math.isfinite(tokens) else None
