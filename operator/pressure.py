"""Decode pressure between aggregations: the state the tuner's pressure rule needs. Pure.

Reports carry each engine's preemption counter since its sidecar started. The
tuner wants "did decode preempt requests lately", so the publisher keeps one
:class:`PreemptionWindow` per server between aggregations and asks it for the
preemptions of the last ``window`` seconds:

- a pod seen before, same sidecar start: the counter's rise since then;
- a pod whose sidecar restarted (``startedAt`` changed): its whole counter is new;
- a pod seen for the first time: its counter counts only when its sidecar started
  within the window (old preemptions must not be replayed as new).

A window, not "since the last report": one burst keeps the recommendation lowered
for ``window`` seconds instead of flapping back on the next aggregation. For the
same reason :class:`UsagePeak` gives the tuner the highest decode KV usage of the
window rather than the latest (seen on the engine tier: usage hovering around the
high-water mark flipped the recommendation, and its Event, every few seconds).

The state survives the operator: a new leader, or a restarted operator, has empty
memory, so the publisher writes it into the KVCacheStatus status on every pass and
:func:`seed` rebuilds both windows from that status on its first pass for a server:

- per pod, the counter the window last saw and its sidecar's start are the pod's
  row (``status.pods[].preemptions`` and ``startedAt``): that pod is then "seen
  before", and only its rise beyond that counter is new. The row and the window's
  rises are written in one patch, so a rise is in the rises or beyond the row's
  counter, never both: nothing is counted twice;
- the rises and usage peaks of the window are ``status.pressure``, coalesced per
  minute of the wall clock (:data:`BUCKET_SECONDS`) so that status stays small
  (at most :func:`max_entries` entries each): an entry carries the latest time of
  its minute, and a time is written rounded up to the second. Both keep a rise or
  a peak up to a minute longer than it happened, never shorter: an inexact window
  errs toward "pressure seen".

The sidecar's start is written to the second, so starts are compared to the
second (:func:`same_start`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from kvferry_wire.protocol import ROLE_DECODE
from kvferry_wire.report import Report

from .api import iso_time, parse_time

# Long enough to outlast a burst of preemptions and a few publish cycles; short
# enough that retention recovers within minutes once the pressure is gone.
WINDOW_SECONDS = 600.0
# Rises and usage peaks of one minute share one entry (status stays small).
BUCKET_SECONDS = 60.0


def max_entries(window: float = WINDOW_SECONDS, bucket: float = BUCKET_SECONDS) -> int:
    """The most entries a window keeps: the minutes it spans, both ends counted."""
    return math.ceil(window / bucket) + 1


def same_start(a: float, b: float) -> bool:
    """One sidecar's start, one read from the report and one from status (written to
    the second): the same sidecar. A sidecar restarts in more than a second."""
    return abs(a - b) < 1.0


def _add(entries: deque[tuple[float, float]], now: float, value: float, bucket: float, peak: bool):
    """Fold ``value`` at ``now`` into the entry of its minute: rises add up, peaks keep
    the highest; the entry takes the later time."""
    if entries and math.floor(entries[-1][0] / bucket) == math.floor(now / bucket):
        t, v = entries.pop()
        entries.append((max(t, now), max(v, value) if peak else v + value))
    else:
        entries.append((now, value))


def _expire(entries: deque[tuple[float, float]], now: float, window: float, limit: int, peak: bool):
    """Drop the entries older than the window. Past ``limit`` entries (a clock that
    went back) the two oldest merge as in :func:`_add`: nothing leaves early."""
    while entries and now - entries[0][0] > window:
        entries.popleft()
    while len(entries) > limit:
        (t0, v0), (t1, v1) = entries.popleft(), entries.popleft()
        entries.appendleft((max(t0, t1), max(v0, v1) if peak else v0 + v1))


@dataclass
class PreemptionWindow:
    window: float = WINDOW_SECONDS
    bucket: float = BUCKET_SECONDS
    # pod -> (its sidecar's start, the counter last seen)
    _seen: dict[str, tuple[float, int]] = field(default_factory=dict)
    # (latest time, rises) per minute, oldest first
    _rises: deque[tuple[float, float]] = field(default_factory=deque)

    def observe(self, reports: list[Report], now: float) -> int:
        """Fold in the decode pods' latest reports; preemptions within the window."""
        rise = 0
        for rep in reports:
            if rep.role != ROLE_DECODE:
                continue  # pinned handles live on decode: its pressure is what retention moves
            count = rep.engine.preemptions
            before = self._seen.get(rep.pod)
            if before is None:
                new = count if now - rep.started_at <= self.window else 0
            elif not same_start(before[0], rep.started_at):
                new = count
            else:
                new = max(0, count - before[1])
            self._seen[rep.pod] = (rep.started_at, count)
            rise += new
        if rise:
            _add(self._rises, now, rise, self.bucket, peak=False)
        _expire(self._rises, now, self.window, max_entries(self.window, self.bucket), peak=False)
        return self.recent()

    def recent(self) -> int:
        return int(sum(n for _, n in self._rises))

    def seen(self, pod: str, started_at: float, count: int) -> None:
        """What a previous window saw of ``pod``: its next report counts from there."""
        self._seen[pod] = (started_at, count)

    def rose(self, when: float, count: int) -> None:
        """A rise a previous window counted at ``when`` (oldest first)."""
        if count > 0:
            _add(self._rises, when, count, self.bucket, peak=False)

    def rises(self) -> list[tuple[float, int]]:
        return [(t, int(n)) for t, n in self._rises]


@dataclass
class UsagePeak:
    window: float = WINDOW_SECONDS
    bucket: float = BUCKET_SECONDS
    # (latest time, highest usage) per minute, oldest first
    _samples: deque[tuple[float, float]] = field(default_factory=deque)

    def observe(self, reports: list[Report], now: float) -> float | None:
        """Fold in the decode pods' latest KV usage; the highest within the window."""
        usage = [
            r.engine.kv_usage
            for r in reports
            if r.role == ROLE_DECODE and r.engine.kv_usage is not None
        ]
        if usage:
            _add(self._samples, now, max(usage), self.bucket, peak=True)
        _expire(self._samples, now, self.window, max_entries(self.window, self.bucket), peak=True)
        return self.peak()

    def peak(self) -> float | None:
        return max((u for _, u in self._samples), default=None)

    def sampled(self, when: float, usage: float) -> None:
        """A peak a previous window kept at ``when`` (oldest first)."""
        _add(self._samples, when, usage, self.bucket, peak=True)

    def samples(self) -> list[tuple[float, float]]:
        return list(self._samples)


def _time(value: float) -> str:
    # Rounded up: an entry read back never leaves the window before it would have.
    return iso_time(math.ceil(value))


def status(preemptions: PreemptionWindow, usage: UsagePeak) -> dict[str, Any] | None:
    """``status.pressure``: the windows' entries (the per-pod counters are the pods'
    rows); None when both are empty."""
    rises = [{"time": _time(t), "count": n} for t, n in preemptions.rises()]
    peaks = [{"time": _time(t), "kvUsage": u} for t, u in usage.samples()]
    out = {**({"preemptions": rises} if rises else {}), **({"kvUsage": peaks} if peaks else {})}
    return out or None


def _entries(value: Any, key: str) -> list[tuple[float, Any]]:
    """(time, value) of well-formed entries, oldest first; anything else is skipped."""
    out = []
    for entry in value if isinstance(value, list) else []:
        if not isinstance(entry, dict):
            continue
        when, figure = parse_time(entry.get("time")), entry.get(key)
        if when is not None and isinstance(figure, int | float) and not isinstance(figure, bool):
            out.append((when, figure))
    return sorted(out, key=lambda e: e[0])


def _rows(value: Any) -> Iterable[tuple[str, float, int]]:
    for row in value if isinstance(value, list) else []:
        if not isinstance(row, dict) or row.get("role") != ROLE_DECODE:
            continue
        name, started, count = (
            row.get("name"),
            parse_time(row.get("startedAt")),
            row.get("preemptions"),
        )
        if isinstance(name, str) and started is not None and isinstance(count, int):
            yield name, started, count


def seed(
    kvcs_status: dict[str, Any], window: float = WINDOW_SECONDS
) -> tuple[PreemptionWindow, UsagePeak]:
    """Both windows as a KVCacheStatus status left them (empty from an empty status).
    Entries past the window go on the next ``observe``."""
    preemptions, usage = PreemptionWindow(window=window), UsagePeak(window=window)
    for pod, started, count in _rows(kvcs_status.get("pods")):
        preemptions.seen(pod, started, count)
    block = kvcs_status.get("pressure")
    block = block if isinstance(block, dict) else {}
    for when, count in _entries(block.get("preemptions"), "count"):
        preemptions.rose(when, int(count))
    for when, peak in _entries(block.get("kvUsage"), "kvUsage"):
        usage.sampled(when, float(peak))
    return preemptions, usage
