"""What D pins for this sidecar, kept on disk so that a sidecar that restarts can
release what it held.

A decode sidecar that restarts (a crash, an OOM kill, a failed liveness probe: the
pod and its engine stay) forgets the handles it held, and D keeps their blocks until
``decoder_kv_blocks_ttl``, the ceiling. The higher the ceiling, the costlier that
is. So the sidecar writes a journal on the pod's emptyDir (it outlives the
container, not the pod; D outlives neither): a ``pin`` line when D returns a handle,
a ``gone`` line when D freed it (a pull read it, a release landed). A sidecar that
starts reads the journal back: each handle pinned, not gone and before D's deadline
is an **orphan**, released through P like any handle dropped unread, and counted
apart (``orphans`` in the residency report; ``pinned.orphanedHandles`` while D still
holds them).

- **Wall-clock deadlines**: the monotonic clock of the process that wrote a line is
  not the reader's to trust.
- **One engine's**: each line names D's process start (its ``process_start_time``);
  a line of another D is void, since that D freed everything when it stopped.
- **Bounded**: the live set is at most what the store and the release ledger hold
  (their caps, and D's blocks bound the block ids the lines carry). The file is
  rewritten (a temp file, then a rename) once it holds more than twice the live
  lines, dropping what is past its deadline; a read takes at most
  ``MAX_READ_BYTES`` and ``max_entries`` pins.
- **Hostile or torn lines lose nothing else**: each line is parsed strictly
  (msgspec, bounded fields; JSON nested past ``MAX_DEPTH`` is refused before it is
  parsed, since the parser's own bound is a RecursionError; ``params`` holds no
  integer past 64 bits); one that does not parse, whatever it holds (a torn last
  line after a crash is the usual one), is skipped, counted, and the first few are
  logged by number. No line stops the sidecar: the file outlives its restarts.
- **A journal that cannot be written stops nothing**: the turn goes on; the failure
  is logged (the first, then every ``LOG_EVERY``-th) and counted, and the next write
  tries again.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any

import msgspec

from kvferry_wire.jsondepth import nested_deeper_than

log = logging.getLogger("kvferry.sidecar.pinjournal")

# The file stays under this: past it, a rewrite; still past it, new pins go
# unnoted (they go at D's deadline if the sidecar dies, as with no journal). The
# operator's emptyDir limit is twice that and more (the rewrite's temp file).
MAX_FILE_BYTES = 48 * 1024 * 1024
# A journal bigger than this (not written by this module) is read only this far.
MAX_READ_BYTES = 64 * 1024 * 1024
MAX_ENTRIES = 200_000
# Lines written beyond twice the live ones (plus this slack) trigger a rewrite.
COMPACT_SLACK = 1024
LOG_EVERY = 100
BAD_LINES_LOGGED = 5
# A line is a pin, its params D's kv_transfer_params (block ids: lists of lists):
# a few levels. Deeper is refused unparsed (the parser would raise RecursionError).
MAX_DEPTH = 16
_INT64 = range(-(1 << 63), 1 << 63)

Key = Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 31)]


class Pin(msgspec.Struct, frozen=True, tag="pin", forbid_unknown_fields=True):
    """D pinned ``blocks`` blocks under ``key`` (its request id) until ``deadline``."""

    key: Key
    blocks: Count
    deadline: float  # wall clock (time.time())
    # D's kv_transfer_params as it returned them, and the prompt's first token: what
    # a release request through P carries (release.release_body).
    params: dict[str, Any]
    token: Count
    model: Annotated[str, msgspec.Meta(max_length=1024)] | None = None
    engine: float | None = None  # D's process start; None: not known when written


class Gone(msgspec.Struct, frozen=True, tag="gone", forbid_unknown_fields=True):
    key: Key


Line = Pin | Gone
_decode = msgspec.json.Decoder(Line).decode
_encode = msgspec.json.Encoder().encode


@dataclass
class Recovered:
    """What a journal held when read back."""

    orphans: list[Pin] = field(default_factory=list)  # live: release them
    expired: int = 0  # past D's deadline: D freed them already
    void: int = 0  # another D's: freed when that engine stopped
    bad_lines: int = 0
    truncated: bool = False  # the file was longer than MAX_READ_BYTES


def _line(raw: bytes) -> Line:
    """One journal line, or DecodeError/ValidationError naming what is wrong."""
    if nested_deeper_than(raw, MAX_DEPTH):
        raise msgspec.DecodeError(f"JSON nested deeper than {MAX_DEPTH} levels")
    line = _decode(raw)
    if isinstance(line, Pin):
        _check_ints(line.params)
    return line


def _check_ints(value: Any) -> None:
    """No integer in ``value`` (at most MAX_DEPTH deep) is past 64 bits: D hands out
    none, and a release carries them to P."""
    todo = [value]
    while todo:
        item = todo.pop()
        if isinstance(item, dict):
            todo.extend(item.values())
        elif isinstance(item, list):
            todo.extend(item)
        elif isinstance(item, int) and not isinstance(item, bool) and item not in _INT64:
            raise msgspec.ValidationError("Integer value out of range - at `$.params[...]`")


class PinJournal:
    """The journal of one decode sidecar (one file; nobody else writes it)."""

    def __init__(
        self,
        path: Path,
        *,
        wall: Callable[[], float] = time.time,
        max_entries: int = MAX_ENTRIES,
        on_error: Callable[[], None] | None = None,
    ) -> None:
        self.path = path
        self._wall = wall
        self._max_entries = max_entries
        self._on_error = on_error
        self.live: dict[str, Pin] = {}
        self._lines = 0  # lines in the file now
        self._bytes = 0  # and their bytes
        self.unnoted = 0  # pins not noted: the file was full
        self._file: Any = None
        self.errors = 0

    # ------------------------------------------------------------ reading back

    def recover(self, engine: float | None) -> Recovered:
        """Read what an earlier process left, keep its live pins (they are still
        pinned until released) and start the file again with them alone."""
        out = Recovered()
        pins: dict[str, Pin] = {}
        try:
            with open(self.path, "rb") as f:
                data = f.read(MAX_READ_BYTES + 1)
        except FileNotFoundError:
            data = b""
        except OSError as exc:
            self._failed("read", exc)
            data = b""
        if len(data) > MAX_READ_BYTES:
            out.truncated = True
            data = data[: data.rfind(b"\n", 0, MAX_READ_BYTES) + 1]
            log.warning(
                "pin journal longer than %s bytes; read that far path=%s",
                MAX_READ_BYTES,
                self.path,
            )
        for number, raw in enumerate(data.split(b"\n"), start=1):
            if not raw.strip():
                continue
            try:
                line = _line(raw)
            except (msgspec.DecodeError, msgspec.ValidationError, RecursionError) as exc:
                out.bad_lines += 1
                if out.bad_lines <= BAD_LINES_LOGGED:
                    log.warning(
                        "pin journal line skipped path=%s line=%s err=%s", self.path, number, exc
                    )
                continue
            if isinstance(line, Gone):
                pins.pop(line.key, None)
            elif len(pins) < self._max_entries or line.key in pins:
                pins[line.key] = line
        now = self._wall()
        for pin in pins.values():
            if pin.deadline <= now:
                out.expired += 1
            elif engine is not None and pin.engine is not None and pin.engine != engine:
                out.void += 1
            else:
                out.orphans.append(pin)
        self.live = {p.key: p for p in out.orphans}
        self._rewrite()
        return out

    # ------------------------------------------------------------ writing

    def pinned(self, pin: Pin) -> None:
        if pin.key in self.live:
            return
        line = _encode(pin) + b"\n"
        if len(self.live) >= self._max_entries or self._bytes + len(line) > MAX_FILE_BYTES:
            self._prune()
            self._rewrite()
            if len(self.live) >= self._max_entries or self._bytes + len(line) > MAX_FILE_BYTES:
                self.unnoted += 1  # bounded: it goes at D's deadline if the sidecar dies
                if self.unnoted == 1 or self.unnoted % LOG_EVERY == 0:
                    log.warning("pin journal full path=%s unnoted=%s", self.path, self.unnoted)
                return
        self.live[pin.key] = pin
        self._append(line)

    def gone(self, key: str) -> None:
        if self.live.pop(key, None) is None:
            return
        self._append(_encode(Gone(key)) + b"\n")

    def clear(self) -> None:
        """D restarted: nothing it pinned for us is left."""
        self.live.clear()
        self._rewrite()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def _append(self, line: bytes) -> None:
        try:
            if self._file is None:
                self._file = open(self.path, "ab")  # noqa: SIM115 - kept open
            # One write per line, flushed: a crash of this process loses nothing the
            # kernel holds (no fsync: a node crash takes D's KV with it).
            self._file.write(line)
            self._file.flush()
            self._lines += 1
            self._bytes += len(line)
        except OSError as exc:
            self._failed("write", exc)
            self.close()
            return
        if self._lines > 2 * len(self.live) + COMPACT_SLACK:
            self._prune()
            self._rewrite()

    def _prune(self) -> None:
        now = self._wall()
        for key in [k for k, p in self.live.items() if p.deadline <= now]:
            del self.live[key]

    def _rewrite(self) -> None:
        self.close()
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            size = 0
            with open(tmp, "wb") as f:
                for pin in self.live.values():
                    size += f.write(_encode(pin) + b"\n")
            os.replace(tmp, self.path)
            self._lines, self._bytes = len(self.live), size
        except OSError as exc:
            self._failed("rewrite", exc)

    def _failed(self, what: str, exc: OSError) -> None:
        self.errors += 1
        if self._on_error is not None:
            self._on_error()
        if self.errors == 1 or self.errors % LOG_EVERY == 0:
            log.warning(
                "pin journal %s failed path=%s errors=%s err=%s", what, self.path, self.errors, exc
            )
