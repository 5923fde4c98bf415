"""The report endpoint's serving certificate, reloaded when its files change.

The certificate comes from a Secret volume. When the Secret is rotated (cert-manager
renews it, or a person replaces it), the kubelet swaps the files in place; the
sidecars trust the CA from the server's ConfigMap, which the operator re-renders
from the new ``ca.crt``. An operator that kept serving the certificate it read at
start would then fail every push quietly, so the certificate follows the files:

- the server's ``SSLContext`` gets an SNI callback, which every TLS handshake
  passes through (with or without a server name); it hands the handshake the
  current context;
- the current context is rebuilt when the files' identity (inode, size, mtime)
  changes, checked at most once a second; a pair that does not load (a key that
  does not match, a half-written file) is logged and the previous one kept.

Connections already open keep the certificate they started with.
"""

from __future__ import annotations

import logging
import os
import ssl
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

# How often a handshake may look at the files.
CHECK_SECONDS = 1.0

Stamp = tuple[tuple[int, int, int], ...]


def server_context(cert_file: str, key_file: str) -> ssl.SSLContext:
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(cert_file, key_file)
    return ctx


class ReloadingCert:
    """``context`` is the SSLContext to serve with; it always presents the
    certificate the files hold now (or the last pair that loaded)."""

    def __init__(
        self,
        cert_file: str,
        key_file: str,
        clock: Callable[[], float] = time.monotonic,
        check_seconds: float = CHECK_SECONDS,
    ) -> None:
        self.cert_file = cert_file
        self.key_file = key_file
        self.clock = clock
        self.check_seconds = check_seconds
        self._lock = threading.Lock()
        self._stamp = self._read_stamp()
        # Fails at start when the files are missing or do not match: nothing to serve.
        self._current = server_context(cert_file, key_file)
        self._checked = clock()
        self.reloads = 0
        self.context = server_context(cert_file, key_file)
        self.context.sni_callback = self._on_client_hello

    def _read_stamp(self) -> Stamp:
        # os.stat follows the Secret volume's ..data symlink: a swap changes the inode.
        stats = [os.stat(path) for path in (self.cert_file, self.key_file)]
        return tuple((s.st_ino, s.st_size, s.st_mtime_ns) for s in stats)

    def current(self) -> ssl.SSLContext:
        now = self.clock()
        with self._lock:
            if now - self._checked < self.check_seconds:
                return self._current
            self._checked = now
            try:
                stamp = self._read_stamp()
            except OSError as exc:  # mid-swap or gone: keep serving what we have
                log.warning("serving certificate unreadable, keeping the loaded one: %s", exc)
                return self._current
            if stamp == self._stamp:
                return self._current
            self._stamp = stamp
            try:
                self._current = server_context(self.cert_file, self.key_file)
            except (OSError, ssl.SSLError) as exc:
                log.error(
                    "serving certificate changed but does not load (%s); still serving the "
                    "previous one",
                    exc,
                )
                return self._current
            self.reloads += 1
            log.info("serving certificate reloaded from %s", self.cert_file)
            return self._current

    def _on_client_hello(
        self, ssl_object: ssl.SSLObject, server_name: str | None, ctx: ssl.SSLContext
    ) -> None:
        ssl_object.context = self.current()
