"""What aiohttp's server logs: a client's malformed request is counted, not a traceback.

aiohttp answers a request its parser refuses (a bad request line, a bad or oversized
header, bytes that are no HTTP) with a 400 and logs ``Error handling request`` with the
parser's traceback, once per connection: any client can fill the pod's log with them.
``ServerLog`` stands in for aiohttp's server logger (``handler_args["logger"]``, one
per app): such an error becomes ``kvferry_malformed_requests_total{reason}`` and at most
one short line per ``LOG_WINDOW_SECONDS`` (saying how many were quiet since the last),
and the client still gets aiohttp's 400. Everything else, above all an exception of
our own code (aiohttp's 500 path), goes to aiohttp's logger as it was, traceback and all.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from aiohttp import http_exceptions as hx

from . import logfmt

log = logging.getLogger(__name__)

# One line per this many seconds at most, whatever the rate of malformed requests.
LOG_WINDOW_SECONDS = 10.0

# The counter's reasons, most specific class first (BadHttpMethod is a BadStatusLine,
# every one of them a BadHttpMessage). A fixed set: a label never takes a client's text.
_REASONS: tuple[tuple[type[BaseException], str], ...] = (
    (hx.BadHttpMethod, "bad-method"),
    (hx.BadStatusLine, "bad-request-line"),
    (hx.LineTooLong, "line-too-long"),
    (hx.InvalidHeader, "invalid-header"),
    (hx.InvalidURLError, "invalid-url"),
    (hx.PayloadEncodingError, "bad-payload"),
    (hx.HttpProcessingError, "bad-message"),
)
REASONS = tuple(reason for _, reason in _REASONS)


def reason_of(exc: BaseException | None) -> str | None:
    """The counter's reason for a client's malformed request; None for anything else."""
    if exc is None:
        return None
    for cls, reason in _REASONS:
        if isinstance(exc, cls):
            return reason
    return None


class LogLimiter:
    """At most one line per window; counts the ones it held back."""

    def __init__(
        self, window: float = LOG_WINDOW_SECONDS, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.window = window
        self.clock = clock
        self._next = float("-inf")
        self._suppressed = 0

    def allow(self) -> bool:
        now = self.clock()
        if now < self._next:
            self._suppressed += 1
            return False
        self._next = now + self.window
        return True

    def take_suppressed(self) -> int:
        n, self._suppressed = self._suppressed, 0
        return n


class ServerLog(logging.LoggerAdapter):  # type: ignore[type-arg]
    """aiohttp's server logger, minus the traceback flood (module docstring).

    aiohttp calls ``logger.exception`` (and ``logger.debug`` for a first request
    whose method is no HTTP: TLS to a plain port) with the parser's error as
    ``exc_info``; ``count`` is called with the reason of each malformed request."""

    def __init__(self, logger: logging.Logger, count: Callable[[str], None]) -> None:
        super().__init__(logger, {})
        self.count = count
        self.limiter = LogLimiter()

    def _malformed(self, kwargs: dict[str, Any], args: tuple[Any, ...]) -> bool:
        reason = reason_of(_exception(kwargs.get("exc_info")))
        if reason is None:
            return False
        self.count(reason)
        if self.limiter.allow():
            remote = args[0] if args else None
            log.warning(
                "malformed request reason=%s remote=%s quiet_since_last=%d "
                "(counted in kvferry_malformed_requests_total, one line per %gs)",
                reason,
                logfmt.value(remote),
                self.limiter.take_suppressed(),
                self.limiter.window,
            )
        return True

    def exception(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if not self._malformed(kwargs, args):
            self.logger.exception(msg, *args, **kwargs)

    def debug(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if not self._malformed(kwargs, args):
            self.logger.debug(msg, *args, **kwargs)

    def error(self, msg: object, *args: Any, **kwargs: Any) -> None:
        if not self._malformed(kwargs, args):
            self.logger.error(msg, *args, **kwargs)


def _exception(exc_info: Any) -> BaseException | None:
    if isinstance(exc_info, BaseException):
        return exc_info
    if isinstance(exc_info, tuple) and len(exc_info) == 3:
        return exc_info[1]  # type: ignore[no-any-return]
    return None
