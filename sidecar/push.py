"""Push the residency report to the operator on an interval.

``POST <operatorUrl>`` (the chart's Service, e.g.
``https://kvferry.kvferry-system.svc:8443/v1/reports``) with the JSON report,
``Authorization: Bearer <token>``. The token is the pod's projected ServiceAccount
token for the ``kvferry`` audience; the kubelet rotates the file, so it is read again
for every push. TLS is verified against ``operatorCaFile`` when set (re-read when the
file changes), else the system trust store. A push is bounded in time; a failure is
logged at most once a minute and never stops the loop: the report is cumulative, so
the next push carries everything the failed one did.

The operator's answer to an accepted push carries its server's live policy
(``kvferry_wire.policy``); ``on_answer`` gets the answer's JSON object, read up to
``MAX_RESPONSE_BYTES``. An answer that is too long or not a JSON object is logged
(at most once a minute) and handed on as nothing: the push itself was accepted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import ssl
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import aiohttp

from kvferry_wire.policy import MAX_RESPONSE_BYTES
from kvferry_wire.protocol import HDR_OPERATOR_STANDBY

log = logging.getLogger(__name__)

PUSH_TIMEOUT_S = 10.0
LOG_EVERY_S = 60.0


class PushError(Exception):
    pass


async def _read_at_most(resp: aiohttp.ClientResponse, limit: int) -> bytes:
    """The body, or its first ``limit`` bytes: one ``read`` returns what has arrived."""
    out = bytearray()
    while len(out) < limit:
        chunk = await resp.content.read(limit - len(out))
        if not chunk:
            break
        out += chunk
    return bytes(out)


class Pusher:
    def __init__(
        self,
        url: str,
        body: Callable[[], bytes],
        *,
        token_file: str | None,
        ca_file: str | None,
        interval_s: float,
        timeout_s: float = PUSH_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
        on_result: Callable[[bool], None] | None = None,
        on_answer: Callable[[Any], None] | None = None,
    ) -> None:
        self.url = url
        self.body = body
        self.token_file = token_file
        self.ca_file = ca_file
        self.interval_s = interval_s
        self.timeout_s = min(timeout_s, max(interval_s, 1.0))
        self._clock = clock
        self._on_result = on_result
        self._on_answer = on_answer
        self._last_answer_log = -LOG_EVERY_S
        self._last_log = -LOG_EVERY_S
        self._ssl: ssl.SSLContext | None = None
        self._ca_mtime: float | None = None
        self.failures = 0
        self.successes = 0
        self.standby_refusals = 0

    def token(self) -> str | None:
        """The current token, read fresh; None when no token file is configured."""
        if not self.token_file:
            return None
        try:
            token = Path(self.token_file).read_text().strip()
        except OSError as exc:
            raise PushError(f"token file {self.token_file} unreadable: {exc}") from exc
        if not token:
            raise PushError(f"token file {self.token_file} is empty")
        return token

    def ssl_context(self) -> ssl.SSLContext | bool:
        if not self.url.startswith("https://"):
            return False
        if not self.ca_file:
            return True  # aiohttp's default: verified against the system trust store
        try:
            mtime = os.stat(self.ca_file).st_mtime
        except OSError as exc:
            raise PushError(f"CA file {self.ca_file} unreadable: {exc}") from exc
        if self._ssl is None or mtime != self._ca_mtime:
            self._ssl = ssl.create_default_context(cafile=self.ca_file)
            self._ca_mtime = mtime
        return self._ssl

    async def push_once(self, session: aiohttp.ClientSession) -> bool:
        """One push; True when the operator accepted it. Never raises (but cancels).
        A standby replica's refusal is sent again once, at once: it closed the
        connection, and the Service balances the new one to the leader."""
        for _ in range(2):
            standby = await self._push(session)
            if standby is None:
                return True
            if not standby:
                return False
        self._failed("two operator standbys in a row answered 503; the next push retries")
        return False

    async def _push(self, session: aiohttp.ClientSession) -> bool | None:
        """None when accepted; else whether a standby refused it."""
        try:
            headers = {"Content-Type": "application/json"}
            token = self.token()
            if token is not None:
                headers["Authorization"] = f"Bearer {token}"
            async with session.post(
                self.url,
                data=self.body(),
                headers=headers,
                ssl=self.ssl_context(),
                timeout=aiohttp.ClientTimeout(total=self.timeout_s),
            ) as resp:
                if resp.status == 503 and resp.headers.get(HDR_OPERATOR_STANDBY):
                    self.standby_refusals += 1
                    return True
                if resp.status >= 300:
                    detail = (await resp.read())[:300].decode("utf-8", "replace")
                    raise PushError(f"operator answered {resp.status}: {detail}")
                answer = await _read_at_most(resp, MAX_RESPONSE_BYTES + 1)
        except asyncio.CancelledError:
            raise
        except (PushError, aiohttp.ClientError, TimeoutError, ssl.SSLError, OSError) as exc:
            self._failed(str(exc) or type(exc).__name__)
            return False
        except Exception as exc:  # a bug here must not end the loop
            log.exception("report push failed unexpectedly")
            self._failed(repr(exc), logged=True)
            return False
        self.successes += 1
        if self._on_result:
            self._on_result(True)
        if self._on_answer:
            self._on_answer(self._answer(answer))
        return None

    def _answer(self, raw: bytes) -> Any:
        """The accepted push's answer as JSON, or None (logged) when it is not one."""
        why = None
        if len(raw) > MAX_RESPONSE_BYTES:
            why = f"longer than {MAX_RESPONSE_BYTES} bytes"
        else:
            try:
                value = json.loads(raw or b"{}")
            except (ValueError, RecursionError) as exc:  # deep nesting: RecursionError
                why = f"not JSON: {type(exc).__name__}"
            else:
                if isinstance(value, dict):
                    return value
                why = f"not a JSON object: {type(value).__name__}"
        now = self._clock()
        if now - self._last_answer_log >= LOG_EVERY_S:
            self._last_answer_log = now
            log.warning("report answer ignored url=%s err=%s", self.url, why)
        return None

    def _failed(self, why: str, *, logged: bool = False) -> None:
        self.failures += 1
        if self._on_result:
            self._on_result(False)
        now = self._clock()
        if not logged and now - self._last_log >= LOG_EVERY_S:
            self._last_log = now
            log.warning(
                "residency report push failed url=%s failures=%s err=%s",
                self.url,
                self.failures,
                why,
            )

    async def run(self, session: aiohttp.ClientSession) -> None:
        """Push every ``interval_s`` until cancelled."""
        log.info("pushing residency reports url=%s every=%ss", self.url, self.interval_s)
        while True:
            await asyncio.sleep(self.interval_s)
            await self.push_once(session)
