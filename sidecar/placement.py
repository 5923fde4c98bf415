"""Where a turn's prefill runs: on P (the P path) or on D alone. Pure.

The two ways to get a turn's first token, priced with the costs this sidecar
measured on its own turns (``kvferry_wire.costfit``: least squares over every leg
it timed, refitted as legs come in):

- **the P path**: P's leg (pull the handle's tokens when it has one, compute the
  rest) then D's leg (read the prompt's KV from P, except what D's prefix cache
  holds, and sample the first token);
- **D alone**: D's leg computing the prompt tokens its prefix cache does not hold
  (through the session's pinned handle or its KV events), then the first token.

D alone costs more than its own time to first token: while D computes the tail
(``compute`` seconds), each stream D is decoding waits about as long (its next token
comes a step later), and each turn that reaches D meanwhile waits, on average, half
of it. So the seconds D spends computing count once more per stream in flight on D
(``running``) and the turns expected during them add ``arrivals x compute² / 2``
(``arrivals``: the rate of D legs over the last minute, the M/G/1 view of one job's
effect on those behind it). The P path's cost to the others (D reading KV over
NIXL, in the background of D's steps) is left out. So:

    D alone   when   alone + compute x (running + arrivals x compute / 2)   <   P path

as NVIDIA Dynamo's conditional disaggregation decides, with the measured costs and
D's load in place of its fixed length and queue limits.

Until both fits can say what each way costs (too few legs of one kind: a new pod,
or traffic that never took one way), the rule decides: D alone when the uncached
tail is shorter than ``skipPrefillBelowTokens``. That is also the whole rule under
``prefillPlacement: Threshold``. Every choice says which decided and with what
figures (``Choice``), for the turn's log line and ``kvferry_placement_total``.

What is not modelled: P's own prefix cache (a P that holds the prompt computes
less than the fit says; the fit's average absorbs it), a P's queue beyond what its
leg times show, and the turn's later tokens (D decodes them either way).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from kvferry_wire import costfit
from kvferry_wire.policy import PLACEMENT_MEASURED

# Choice.decided_by
BY_RULE = "rule"  # prefillPlacement Threshold: skipPrefillBelowTokens
BY_COSTS = "costs"  # the measured costs
BY_COLD = "cold"  # Measured, but a fit cannot say yet: the rule


@dataclass(frozen=True)
class Costs:
    """Both fits, solved (``Unsolved`` says why a fit cannot be used yet)."""

    prefill: costfit.Solved | costfit.Unsolved
    decode: costfit.Solved | costfit.Unsolved

    @property
    def known(self) -> bool:
        return isinstance(self.prefill, costfit.Solved) and isinstance(self.decode, costfit.Solved)

    @property
    def why_unknown(self) -> str:
        for name, fit in (("prefill leg", self.prefill), ("decode leg", self.decode)):
            if isinstance(fit, costfit.Unsolved):
                return f"{name}: {fit.reason}"
        return ""


# What each fit must have seen before its coefficients are read for a choice (a feature
# never seen would price at 0: a pull would look free).
PREFILL_NEEDS = (costfit.PULL, costfit.PULLED_TOKENS, costfit.COMPUTED_TOKENS)
DECODE_NEEDS = (costfit.ALONE, costfit.ALONE_COMPUTED_TOKENS, costfit.FETCHED_TOKENS)


@dataclass(frozen=True)
class Turn:
    """The turn as the choice sees it (tokens)."""

    prompt: int
    on_decode: int  # prompt tokens D holds: the handle's pinned blocks or its prefix cache
    pull: int  # tokens P would pull with the handle (0: no usable handle)
    running: int  # D legs in flight besides this turn's
    arrivals: float = 0.0  # D legs a second, of late


@dataclass(frozen=True)
class Choice:
    alone: bool
    decided_by: str
    p_path_s: float | None = None  # predicted time to first token on the P path
    alone_s: float | None = None  # predicted, D alone, its own
    interference_s: float | None = None  # what D's compute of the tail costs the others


def p_path_seconds(costs: Costs, turn: Turn) -> float:
    assert isinstance(costs.prefill, costfit.Solved)
    assert isinstance(costs.decode, costfit.Solved)
    p_leg = costfit.predict(
        costs.prefill,
        {
            costfit.PULL: 1.0 if turn.pull else 0.0,
            costfit.PULLED_TOKENS: turn.pull,
            costfit.COMPUTED_TOKENS: turn.prompt - turn.pull,
        },
    )
    d_leg = costfit.predict(
        costs.decode,
        {costfit.FETCHED_TOKENS: max(0, turn.prompt - turn.on_decode), costfit.OUTPUT_TOKENS: 1},
    )
    return p_leg + d_leg


def alone_seconds(costs: Costs, turn: Turn) -> tuple[float, float]:
    """D alone's time to first token, and the seconds its compute of the tail costs
    the streams D is decoding and the turns that reach D meanwhile."""
    assert isinstance(costs.decode, costfit.Solved)
    tail = max(0, turn.prompt - turn.on_decode)
    own = costfit.predict(
        costs.decode,
        {costfit.ALONE: 1.0, costfit.ALONE_COMPUTED_TOKENS: tail, costfit.OUTPUT_TOKENS: 1},
    )
    compute = costs.decode.coefficients[costfit.ALONE_COMPUTED_TOKENS] * tail
    return own, compute * (max(0, turn.running) + max(0.0, turn.arrivals) * compute / 2)


def choose(placement: str, skip_below: int, turn: Turn, costs: Costs | None) -> Choice:
    """D alone or the P path for ``turn`` (see the module docstring)."""
    by_rule = turn.prompt - turn.on_decode < skip_below
    if placement != PLACEMENT_MEASURED:
        return Choice(by_rule, BY_RULE)
    if costs is None or not costs.known:
        return Choice(by_rule, BY_COLD)
    p_path = p_path_seconds(costs, turn)
    own, interference = alone_seconds(costs, turn)
    return Choice(own + interference < p_path, BY_COSTS, p_path, own, interference)


# The window of D legs the arrival rate is taken over, and the most it remembers (a
# bound on memory under any load: past it the rate reads as at least that many a
# window, which already sends every long prefill to P).
ARRIVAL_WINDOW_S = 60.0
ARRIVAL_CAP = 4096


@dataclass
class Arrivals:
    """D legs a second over the last ``ARRIVAL_WINDOW_S`` (since the first, if more
    recent)."""

    clock: Callable[[], float]
    _times: deque[float] = field(default_factory=lambda: deque(maxlen=ARRIVAL_CAP))

    def note(self) -> None:
        self._times.append(self.clock())

    def rate(self) -> float:
        now = self.clock()
        while self._times and now - self._times[0] > ARRIVAL_WINDOW_S:
            self._times.popleft()
        if not self._times:
            return 0.0
        span = max(now - self._times[0], 1.0)
        return len(self._times) / min(span, ARRIVAL_WINDOW_S) if len(self._times) > 1 else 0.0
