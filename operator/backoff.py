"""When to retry a failed apply: an exponential backoff, bounded. Pure.

kopf does not retry ``on.event`` handlers, and the change handlers it does retry
would write progress annotations on every server (the operator writes nothing
there but ``status``). So a failed apply is retried by our own task
(``retries.ApplyRetries``) on this schedule; after its last try the resync loop
(``KVFERRY_RESYNC_SECONDS``) remains the safety net. The schedule adds up to about
one default resync interval.
"""

from __future__ import annotations

BASE_SECONDS = 1.0
FACTOR = 2.0
CAP_SECONDS = 30.0
ATTEMPTS = 6


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
    """The waits before each retry, in order: 1, 2, 4, 8, 16, 30 s by default."""
    return tuple(delay(i, base, factor, cap) for i in range(attempts))
