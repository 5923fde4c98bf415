"""The residency report: what a sidecar tells the operator (wire contract).

Sidecars serve it at ``/v1/residency`` and push it to the operator's report
endpoint; the operator decodes it with :func:`decode`. Counters and
histograms are cumulative since the sidecar started (``startedAt``), so a lost
push loses nothing and the operator can difference two reports.

REPORT_VERSION history:
  1 - first version.
  2 - transport value ``TCP`` (TCP because the spec asked for it, not a fallback);
      ``transportReason`` (the evidence behind ``transport``); ``transfer.transfers``
      (NIXL transfers, the count behind ``bytes`` and ``seconds``). The operator
      reads 1 and 2: a version-1 report decodes with those fields empty.
      Also added in 2, with defaults: ``pinned.unusedHandles``/``unusedBlocks`` (pinned
      KV no turn will read) and ``releases`` (how handles dropped unread were freed).
      Later in 2, with defaults: ``evictions`` (the ``evicted`` handles by the cap that
      evicted them). Not a new version: an operator that does not know the field
      ignores it (unknown fields are), and a report without it reads as no evictions.
      Later in 2, with defaults: ``evictions.pressure``, ``preemption``, ``usefulness``,
      ``retention`` and ``lease`` (the sidecar's retention policy letting handles go);
      an older report reads as none of those, as above.
      Later in 2, with defaults: ``pinned.orphanedHandles``/``orphanedBlocks`` and
      ``orphans`` (handles an earlier process of the sidecar held, found in its pin
      journal at start); an older report reads as none, as above.
      Later in 2, with a default: ``pinned.unreleasableHandles``; an older report reads
      as none.
      Later in 2, with defaults: ``costs`` (the legs' least-squares sums,
      ``kvferry_wire.costfit``) and ``placements`` (where turns were chosen to
      prefill, and what decided); an older report reads as no legs measured and no
      choices counted.

:func:`decode` checks every field, not only the shape: names are Kubernetes
names, counts and sums are finite and not negative, map keys come from fixed
vocabularies (turn buckets, :class:`~kvferry_wire.protocol.Outcome`,
:class:`~kvferry_wire.protocol.HandleFate`), strings and maps are bounded. So
what one pod can add to a server's KVCacheStatus is bounded, and a report the
operator accepts can always be aggregated. The checks walk the decoded value, so
a field added later gets them too. JSON nested deeper than ``MAX_DEPTH``, in any
field or in one the report does not have, is a :class:`ReportError` as well, before
the decoder recurses into it.

A peer that sends a version outside ``READABLE_VERSIONS`` is refused with a
message naming both, rather than being half understood.
"""

from __future__ import annotations

import math
import re
from typing import Any

import msgspec

from . import costfit
from .jsondepth import nested_deeper_than
from .protocol import ROLES, HandleFate, Outcome

REPORT_VERSION = 2
READABLE_VERSIONS = (1, 2)
# Reports are small (a few KiB); anything near this is malformed or hostile.
MAX_REPORT_BYTES = 256 * 1024
# Arrays and objects in a report nest four deep (transfer.pullLatency.bounds); far
# past that is malformed or hostile, refused before the decoder recurses into it.
MAX_DEPTH = 32

# Bucket upper bounds (seconds). Fixed, so histograms from different pods add up.
GAP_BOUNDS: tuple[float, ...] = (
    1, 2, 5, 10, 15, 20, 30, 45, 60, 90, 120, 180, 240, 300, 420, 600, 900, 1200, 1800,
    2700, 3600, 7200, 14400, 43200, 86400,
)  # fmt: skip
LATENCY_BOUNDS: tuple[float, ...] = (
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1, 1.5, 2, 3, 5, 7.5, 10, 20, 30, 60, 120,
)  # fmt: skip
# Turn index buckets for "reuse by turn": 1, 2, ..., 7, and 8 for 8 and later.
MAX_TURN_BUCKET = 8

# What the P<->D KV path uses, as the sidecar can tell (see kvferry_sidecar.transport):
# RDMA; TCP where RDMA was not asked for (network.transport tcp, or auto on a cluster
# without usable RDMA); TCPFallback: TCP although RDMA was asked for; NoTransport: nothing can
# carry KV between pods (the engine's UCX_TLS allows neither a usable RDMA transport nor
# tcp; the operator also says so when every pull failed); Unknown: not enough evidence.
TRANSPORT_RDMA = "RDMA"
TRANSPORT_TCP = "TCP"
TRANSPORT_TCP_FALLBACK = "TCPFallback"
TRANSPORT_NONE = "NoTransport"
TRANSPORT_UNKNOWN = "Unknown"
TRANSPORTS = (
    TRANSPORT_RDMA,
    TRANSPORT_TCP,
    TRANSPORT_TCP_FALLBACK,
    TRANSPORT_NONE,
    TRANSPORT_UNKNOWN,
)

# Bounds checked on decode. Counters are cumulative since a sidecar started: 2**53
# is far above any real count and keeps sums of many pods exact in JSON and int64.
MAX_COUNT = 2**53
MAX_STRING = 1024  # any free-text field (engine build hash, reasons)
MAX_MAP_KEYS = 64  # a map field without a fixed vocabulary
TURN_KEYS = tuple(str(i) for i in range(1, MAX_TURN_BUCKET + 1))
# Map fields whose keys come from a fixed vocabulary: (field path) -> allowed keys.
MAP_KEYS: dict[str, tuple[str, ...]] = {
    "byTurn": TURN_KEYS,
    "outcomes": tuple(o.value for o in Outcome),
    "handles": tuple(f.value for f in HandleFate),
}
# Kubernetes names: a namespace is a DNS-1123 label, pods and servers DNS-1123 subdomains.
_DNS_LABEL = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")
_DNS_SUBDOMAIN = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*")
NAME_FIELDS = {
    "namespace": (_DNS_LABEL, 63),
    "server": (_DNS_SUBDOMAIN, 253),
    "pod": (_DNS_SUBDOMAIN, 253),
}
# Fractions.
UNIT_FIELDS = ("engine.kvUsage",)


class Histogram(msgspec.Struct, rename="camel", forbid_unknown_fields=False):
    """Bucket counts: ``counts[i]`` observations in ``(bounds[i-1], bounds[i]]``, and a
    last overflow count for observations above ``bounds[-1]``.

    The one histogram type of kvferry: the sidecar observes into it, the report
    carries it, the operator merges pods' histograms and reads quantiles from it.
    """

    bounds: list[float]
    counts: list[int]
    sum: float = 0.0

    def __post_init__(self) -> None:
        # Runs on construction and on decode (msgspec turns the ValueError into a
        # ValidationError naming the field), so a malformed histogram never exists.
        self.bounds = [float(b) for b in self.bounds]
        self.counts = list(self.counts)
        if len(self.counts) != len(self.bounds) + 1:
            raise ValueError("a histogram needs one count per bound plus an overflow count")
        if self.bounds != sorted(self.bounds) or any(c < 0 for c in self.counts):
            raise ValueError("bounds must ascend and counts must not be negative")

    @classmethod
    def empty(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(list(bounds), [0] * (len(bounds) + 1), 0.0)

    def observe(self, value: float) -> None:
        for i, bound in enumerate(self.bounds):
            if value <= bound:
                self.counts[i] += 1
                break
        else:
            self.counts[-1] += 1
        self.sum += value

    @property
    def total(self) -> int:
        return sum(self.counts)

    def copy(self) -> Histogram:
        return Histogram(list(self.bounds), list(self.counts), self.sum)

    def quantile(self, q: float) -> tuple[float, bool]:
        """The q-quantile by linear interpolation inside its bucket, and whether it
        fell in the overflow bucket (then the value is only a lower bound)."""
        if self.total == 0:
            return math.nan, False
        rank = q * self.total
        seen = 0
        for i, count in enumerate(self.counts[:-1]):
            if count and seen + count >= rank:
                lo = self.bounds[i - 1] if i > 0 else 0.0
                return lo + (self.bounds[i] - lo) * max(0.0, rank - seen) / count, False
            seen += count
        return self.bounds[-1], True


def merge_histograms(hists: list[Histogram], bounds: tuple[float, ...]) -> Histogram:
    """Sum histograms that all have ``bounds`` (empty: an empty histogram).
    Other bounds are a caller bug: :func:`decode` refuses reports that carry them."""
    out = Histogram.empty(bounds)
    for h in hists:
        if h.bounds != out.bounds:
            raise ValueError("histograms with different bucket bounds cannot be merged")
        out.counts = [a + b for a, b in zip(out.counts, h.counts, strict=True)]
        out.sum += h.sum
    return out


class TurnBucket(msgspec.Struct, rename="camel"):
    turns: int = 0
    reused_turns: int = 0
    prompt_tokens: int = 0
    reused_tokens: int = 0


class Pinned(msgspec.Struct, rename="camel"):
    """KV this decode pod's engine keeps pinned for a next turn (vLLM 0.32 also spins
    a core while any is pinned): handles the sidecar holds for sessions, plus the
    ``unused`` ones no turn will read that D has not freed yet (release pending,
    impossible, or failed: they go at D's deadline)."""

    handles: int = 0
    blocks: int = 0
    bytes: int = 0
    oldest_age_seconds: float = 0.0
    unused_handles: int = 0
    unused_blocks: int = 0
    # Of the unused, those an earlier process of this sidecar held (its pin journal):
    # being released, or pinned until D's deadline when they cannot be.
    orphaned_handles: int = 0
    orphaned_blocks: int = 0
    # Of the unused, those no release can free (no prefill engine, a failed release
    # request, a pull that broke off): D frees them at its deadline, the ceiling.
    unreleasable_handles: int = 0


class Orphans(msgspec.Struct, rename="camel"):
    """Handles an earlier process of this sidecar held that D still pinned when this
    one started (its pin journal, cumulative since it started)."""

    found: int = 0
    found_blocks: int = 0
    released: int = 0  # D freed them on this sidecar's release
    void: int = 0  # noted for another D (that engine restarted since): nothing to free


class Releases(msgspec.Struct, rename="camel"):
    """Handles dropped unread, by how D was told to free them (cumulative)."""

    rider: int = 0  # on the turn's own prefill request
    request: int = 0  # by a release request of their own
    failed: int = 0  # a release request failed: pinned until D's deadline
    unreleasable: int = 0  # no prefill engine, a failed pull, not returned by D


class Evictions(msgspec.Struct, rename="camel"):
    """Handles the sidecar let go before a turn read them, by reason (cumulative). The
    caps and D's pressure (``storeCap`` to ``preemption``) add up to the ``evicted``
    fate; the ends (``usefulness``, ``retention``, ``lease``) are the store's share of
    the ``expired`` fate. Each is released on D like any handle dropped unread."""

    store_cap: int = 0  # handleStoreCap: the store was full
    owner_handles: int = 0  # an owner over its ownerMaxHandles lost its lowest-value one
    owner_tokens: int = 0  # an owner over its ownerMaxPinnedTokens lost its lowest-value one
    pressure: int = 0  # D's KV usage above the high-water mark: the lowest values went
    preemption: int = 0  # D preempted a request: one lowest-value handle each
    usefulness: int = 0  # the retention policy: the session's next turn is not coming
    retention: int = 0  # the retention in force (at most the ceiling) ran out
    lease: int = 0  # D's lease of a turn it prefilled alone ran out
    admission: int = 0  # a finished turn's handle was worth less than it would displace


class Transfer(msgspec.Struct, rename="camel"):
    pulls: int = 0  # turns served with pulled KV
    bytes: int = 0  # NIXL bytes (engine metric where available)
    seconds: float = 0.0  # NIXL transfer time (engine metric)
    transfers: int = 0  # NIXL transfers behind bytes and seconds (version 2)
    pull_latency: Histogram = msgspec.field(default_factory=lambda: Histogram.empty(LATENCY_BOUNDS))
    # Cost of computing instead: prefill tokens and seconds of recomputed turns.
    recompute_tokens: int = 0
    recompute_seconds: float = 0.0
    bytes_per_token: float | None = None


class Costs(msgspec.Struct, rename="camel"):
    """What each leg of a turn cost, as least-squares sums over the turns this
    sidecar served (``kvferry_wire.costfit``: the features, the weights, the solve)."""

    prefill_leg: costfit.LinearFit = msgspec.field(
        default_factory=lambda: costfit.empty(costfit.PREFILL_LEG)
    )
    decode_leg: costfit.LinearFit = msgspec.field(
        default_factory=lambda: costfit.empty(costfit.DECODE_LEG)
    )


class Placements(msgspec.Struct, rename="camel"):
    """Turns by where the decode sidecar chose to prefill them (P: the P path; D: D
    alone) and what decided: the measured costs and D's load, the skip-prefill rule
    while the costs are not known yet (cold), or the rule alone (prefillPlacement
    Threshold). Cumulative."""

    prefill_by_costs: int = 0
    prefill_by_cold_rule: int = 0
    prefill_by_rule: int = 0
    decode_by_costs: int = 0
    decode_by_cold_rule: int = 0
    decode_by_rule: int = 0


class Engine(msgspec.Struct, rename="camel"):
    kv_usage: float | None = None  # 0..1
    preemptions: int = 0
    nixl_expired: int = 0
    nixl_failed: int = 0
    healthy: bool = False


class KVEvents(msgspec.Struct, rename="camel"):
    blocks_held: int = 0
    sessions_held: int = 0
    batches: int = 0
    missed: int = 0  # sequence gaps seen
    repaired: int = 0  # of those, recovered through the replay socket
    cleared: int = 0  # AllBlocksCleared or engine restarts


class Report(msgspec.Struct, rename="camel", kw_only=True):
    version: int
    server: str
    namespace: str
    pod: str
    role: str  # prefill | decode
    engine_build: str | None = None
    started_at: float  # unix seconds
    generated_at: float  # unix seconds
    transport: str = TRANSPORT_UNKNOWN
    # One line of evidence for ``transport``: configured UCX_TLS and devices, RDMA
    # devices seen in the pod, measured GB/s (version 2).
    transport_reason: str = ""
    outcomes: dict[str, int] = msgspec.field(default_factory=dict)
    # Handle fates: consumed, expired, misaligned, evicted, ...
    handles: dict[str, int] = msgspec.field(default_factory=dict)
    # "1".."8": turn index of the session (8 = 8th and later).
    by_turn: dict[str, TurnBucket] = msgspec.field(default_factory=dict)
    gaps: Histogram = msgspec.field(default_factory=lambda: Histogram.empty(GAP_BOUNDS))
    ttft_reused: Histogram = msgspec.field(default_factory=lambda: Histogram.empty(LATENCY_BOUNDS))
    ttft_recomputed: Histogram = msgspec.field(
        default_factory=lambda: Histogram.empty(LATENCY_BOUNDS)
    )
    pinned: Pinned = msgspec.field(default_factory=Pinned)
    releases: Releases = msgspec.field(default_factory=Releases)
    evictions: Evictions = msgspec.field(default_factory=Evictions)
    orphans: Orphans = msgspec.field(default_factory=Orphans)
    transfer: Transfer = msgspec.field(default_factory=Transfer)
    costs: Costs = msgspec.field(default_factory=Costs)
    placements: Placements = msgspec.field(default_factory=Placements)
    engine: Engine = msgspec.field(default_factory=Engine)
    kv_events: KVEvents = msgspec.field(default_factory=KVEvents)


class ReportError(ValueError):
    """A report that must be refused; the message says why, for the sender's log."""


def _check_histogram(name: str, hist: Histogram, bounds: tuple[float, ...]) -> None:
    # Shape and signs were checked on decode (Histogram.__post_init__).
    if tuple(hist.bounds) != bounds:
        raise ReportError(f"{name}.bounds differ from this operator's buckets")


def _check_value(path: str, value: Any) -> None:
    """Every number finite and not negative, every string and map bounded, map keys
    from their vocabulary; recursing through structs and lists."""
    if value is None or isinstance(value, bool):
        return
    if isinstance(value, int):
        if not 0 <= value <= MAX_COUNT:
            raise ReportError(f"{path} is {value}: counts must be between 0 and 2**53")
    elif isinstance(value, float):
        if not math.isfinite(value) or value < 0:
            raise ReportError(f"{path} is {value}: it must be a finite number, not negative")
        if path in UNIT_FIELDS and value > 1:
            raise ReportError(f"{path} is {value}: it is a fraction (0..1)")
    elif isinstance(value, str):
        if len(value) > MAX_STRING:
            raise ReportError(f"{path} is {len(value)} characters long; at most {MAX_STRING}")
    elif isinstance(value, msgspec.Struct):
        for field in msgspec.structs.fields(value):
            name = field.encode_name
            _check_value(f"{path}.{name}" if path else name, getattr(value, field.name))
    elif isinstance(value, dict):
        allowed = MAP_KEYS.get(path)
        if allowed is None and len(value) > MAX_MAP_KEYS:
            raise ReportError(f"{path} has {len(value)} keys; at most {MAX_MAP_KEYS}")
        for key, item in value.items():
            if allowed is not None and key not in allowed:
                raise ReportError(f"{path} key {key!r} is not one of {', '.join(allowed)}")
            if allowed is None and len(key) > 63:
                raise ReportError(f"{path} key {key[:63]!r}... is longer than 63 characters")
            _check_value(f"{path}[{key!r}]", item)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_value(f"{path}[{i}]", item)


def _brief(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:40] + "..."


def _check_names(report: Report) -> None:
    for name, (pattern, limit) in NAME_FIELDS.items():
        value = getattr(report, name)
        if len(value) > limit or not pattern.fullmatch(value):
            raise ReportError(
                f"{name} {value[:80]!r} is not a Kubernetes name "
                f"(lower-case letters, digits, '-', at most {limit} characters)"
            )


def decode(raw: bytes) -> Report:
    """Parse and check a report; raise :class:`ReportError` naming the problem."""
    if len(raw) > MAX_REPORT_BYTES:
        raise ReportError(f"report of {len(raw)} bytes exceeds {MAX_REPORT_BYTES}")
    if nested_deeper_than(raw, MAX_DEPTH):
        raise ReportError(f"malformed report: JSON nested too deeply (over {MAX_DEPTH} levels)")
    try:
        version = msgspec.json.decode(raw, type=dict[str, Any]).get("version")
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:  # bytes that are no UTF-8
        raise ReportError(f"not JSON: {exc}") from exc
    if version not in READABLE_VERSIONS:
        readable = " and ".join(str(v) for v in READABLE_VERSIONS)
        raise ReportError(f"report version {_brief(version)}; this operator reads {readable}")
    try:
        report = msgspec.json.decode(raw, type=Report)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError) as exc:
        raise ReportError(f"malformed report: {exc}") from exc
    if report.role not in ROLES:
        raise ReportError(f"role {report.role!r} is neither prefill nor decode")
    if report.transport not in TRANSPORTS:
        raise ReportError(f"transport {report.transport!r} is not one of {TRANSPORTS}")
    _check_histogram("gaps", report.gaps, GAP_BOUNDS)
    _check_histogram("ttftReused", report.ttft_reused, LATENCY_BOUNDS)
    _check_histogram("ttftRecomputed", report.ttft_recomputed, LATENCY_BOUNDS)
    _check_histogram("transfer.pullLatency", report.transfer.pull_latency, LATENCY_BOUNDS)
    _check_names(report)
    _check_value("", report)
    # A fit of other features (another kvferry version's) cannot be added to this
    # operator's: read as no legs measured, the rest of the report stands. A fit of its
    # features must be one legs could have made (costfit.check).
    for shape, attr in ((costfit.PREFILL_LEG, "prefill_leg"), (costfit.DECODE_LEG, "decode_leg")):
        fit = getattr(report.costs, attr)
        if tuple(fit.features) != shape.features:
            setattr(report.costs, attr, costfit.empty(shape))
            continue
        why = costfit.check(shape, fit)
        if why is not None:
            raise ReportError(f"costs.{why}")
    return report


def encode(report: Report) -> bytes:
    return msgspec.json.encode(report)
