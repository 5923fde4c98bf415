"""When to retry a failed apply: an exponential backoff, bounded. Pure.

kopf does not retry ``on.event`` handlers, and the change handlers it does retry
would write progress annotations on every server (the operator writes nothing
there but ``status``). So a failed apply is retried by our own task
(``retries.ApplyRetries``) on this schedule: doubling up to the cap, then at the cap,
for about one default interval of the safety pass (``KVFERRY_RESYNC_SECONDS``), which
applies whatever still has not landed after that.
"""

from __future__ import annotations

BASE_SECONDS = 1.0
FACTOR = 2.0
CAP_SECONDS = 30.0
ATTEMPTS = 14  # 1 + 2 + 4 + 8 + 16 + 30 x 9: 301 s


def delay(
    attempt: int, base: float = BASE_SECONDS, factor: float = FACTOR, cap: float = CAP_SECONDS
) -> float:
    """Seconds to wait before retry ``attempt`` (0 is the first retry)."""
    if attempt < 0:
        raise ValueError(f"attempt must be 0 or more, not {attempt}")
    return min(cap, base * factor**attempt)


def schedule(
    attempts: int = ATTEMPTS,
    base: float = BASE_SECONDS,
    factor: float = FACTOR,
    cap: float = CAP_SECONDS,
) -> tuple[float, ...]:
    """The waits before each retry, in order: 1, 2, 4, 8, 16, then 30 s by default."""
    return tuple(delay(i, base, factor, cap) for i in range(attempts))


def jittered(seconds: float, rand: float, spread: float = 0.2) -> float:
    """``seconds`` moved by up to ``spread`` of itself either way; ``rand`` in [0, 1)
    (``random.random()``): periodic passes of operators started together drift apart."""
    if not 0.0 <= rand <= 1.0:
        raise ValueError(f"rand must be in [0, 1], not {rand}")
    return seconds * (1.0 - spread + 2.0 * spread * rand)
