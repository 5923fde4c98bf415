"""Decode pressure between aggregations: the state the tuner's pressure rule needs. Pure.

Reports carry each engine's preemption counter since its sidecar started. The
tuner wants "did decode preempt requests lately", so the publisher keeps one
:class:`PreemptionWindow` per server between aggregations and asks it for the
preemptions of the last ``window`` seconds:

- a pod seen before, same sidecar start: the counter's rise since then;
- a pod whose sidecar restarted (``startedAt`` changed): its whole counter is new;
- a pod seen for the first time: its counter counts only when its sidecar started
  within the window (an operator restart must not replay old preemptions as new).

A window, not "since the last report": one burst keeps the recommendation lowered
for ``window`` seconds instead of flapping back on the next aggregation. For the
same reason :class:`UsagePeak` gives the tuner the highest decode KV usage of the
window rather than the latest (seen on the engine tier: usage hovering around the
high-water mark flipped the recommendation, and its Event, every few seconds).
The state lives in the operator's memory; an operator restart starts it empty.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvferry_wire.protocol import ROLE_DECODE
from kvferry_wire.report import Report

# Long enough to outlast a burst of preemptions and a few publish cycles; short
# enough that retention recovers within minutes once the pressure is gone.
WINDOW_SECONDS = 600.0


@dataclass
class PreemptionWindow:
    window: float = WINDOW_SECONDS
    _seen: dict[str, tuple[float, int]] = field(default_factory=dict)
    _rises: deque[tuple[float, int]] = field(default_factory=deque)

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
            elif before[0] != rep.started_at:
                new = count
            else:
                new = max(0, count - before[1])
            self._seen[rep.pod] = (rep.started_at, count)
            rise += new
        if rise:
            self._rises.append((now, rise))
        while self._rises and now - self._rises[0][0] > self.window:
            self._rises.popleft()
        return sum(n for _, n in self._rises)


@dataclass
class UsagePeak:
    window: float = WINDOW_SECONDS
    _samples: deque[tuple[float, float]] = field(default_factory=deque)

    def observe(self, reports: list[Report], now: float) -> float | None:
        """Fold in the decode pods' latest KV usage; the highest within the window."""
        usage = [
            r.engine.kv_usage
            for r in reports
            if r.role == ROLE_DECODE and r.engine.kv_usage is not None
        ]
        if usage:
            self._samples.append((now, max(usage)))
        while self._samples and now - self._samples[0][0] > self.window:
            self._samples.popleft()
        return max((u for _, u in self._samples), default=None)
