"""Session traces: one turn per JSON line (``session``, ``t`` seconds, ``prompt_tokens``,
``new_tokens``, ``output_tokens``), as ``kvferry-operator what-if`` and
``make bench-eviction`` read them (docs/what-if.md). A bad line is an error naming the
line and the field; nothing is guessed.

``read_trace`` also reads the traces people already hold, and converts them turn by
turn (docs/what-if.md, "Traces you already have"):

* **mooncake**: Mooncake's traces and what ``aiperf synthesize`` writes (aiperf 0.13's
  ``MooncakeTrace``): ``input_length``, ``output_length``, optional ``session_id``,
  ``timestamp`` (ms) and/or ``delay`` (ms after the session's previous turn),
  ``hash_ids`` (one id per ``block_tokens`` tokens, 512 by default).
* **bailian**: Alibaba's Qwen-Bailian usage traces: ``chat_id``, ``parent_chat_id``
  (-1 or absent: a first turn), ``timestamp`` (s), ``input_length``, ``output_length``,
  optional ``hash_ids`` (16-token blocks), ``turn``, ``type``.

The format is detected per file from its first turn (``fmt="auto"``) or given.

Bounds, so that hostile or mistaken input costs neither time nor memory: a line is at
most ``MAX_LINE_BYTES`` and UTF-8; a token count at most ``MAX_TOKENS``; a time at most
``MAX_TIME_SECONDS`` and the trace's span at most ``MAX_SPAN_SECONDS``; at most
``MAX_TURNS`` turns (the file is streamed; what is kept per session is its last turn;
hash ids at most ``MAX_KEPT_HASH_IDS`` in all). NaN and Infinity (which Python's json
reads) are not JSON and are refused. Times are returned relative to the trace's first
turn (it is at 0), so an epoch-stamped trace replays like one that starts at 0.
"""

from __future__ import annotations

import json
import math
from array import array
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELDS = ("session", "t", "prompt_tokens", "new_tokens", "output_tokens")
FORMATS = ("kvferry", "mooncake", "bailian")

MAX_TOKENS = 10_000_000  # per field and turn: past any model's context
MAX_TIME_SECONDS = 1e11  # a turn's time (~3,000 years of Unix time; epoch ms is refused)
MAX_SPAN_SECONDS = 31 * 86400.0  # first turn to last: the bench replays every minute of it
MAX_TURNS = 1_000_000  # turns read from one file (and so sessions)
MAX_LINE_BYTES = 16 * 2**20  # one line (a Bailian turn of MAX_TOKENS: ~5 MB of hash ids)
MAX_KEPT_HASH_IDS = 50_000_000  # hash ids kept across sessions (8 bytes each: 400 MB)
MAX_HASH_ID = 2**64  # a hash id is a 64-bit block hash: 0 <= id < 2**64
MOONCAKE_BLOCK_TOKENS = 512  # Mooncake's and aiperf agentic-code's block_size
BAILIAN_BLOCK_TOKENS = 16  # the Bailian traces' SipHash blocks


@dataclass(frozen=True, slots=True)
class Turn:
    session: str
    t: float
    prompt_tokens: int
    new_tokens: int
    output_tokens: int

    @property
    def prefix(self) -> int:
        return self.prompt_tokens - self.new_tokens

    @property
    def kept_tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens


class TraceError(ValueError):
    pass


def _count(obj: dict[str, Any], name: str, where: str) -> int:
    v = obj[name]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= MAX_TOKENS:
        raise TraceError(f"{where}: field '{name}' must be an integer, 0 to {MAX_TOKENS:,}")
    return v


def _seconds(v: Any, name: str, where: str, scale: float = 1.0, unit: str = "seconds") -> float:
    """A time field >= 0, in seconds after dividing by ``scale``; ints of any size and
    floats compared before any conversion (no OverflowError, no NaN)."""
    limit = MAX_TIME_SECONDS * scale
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not 0 <= v <= limit:
        raise TraceError(f"{where}: field '{name}' must be a number of {unit}, 0 to {limit:g}")
    return float(v) / scale


def parse_turn(obj: Any, where: str) -> Turn:
    """One trace line's object -> a Turn; a bad field is a TraceError naming it."""
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: a turn is a JSON object with the fields {', '.join(FIELDS)}")
    for name in FIELDS:
        if name not in obj:
            raise TraceError(f"{where}: field '{name}' is missing")
    session = obj["session"]
    if not isinstance(session, str) or not session:
        raise TraceError(f"{where}: field 'session' must be a non-empty string")
    t = _seconds(obj["t"], "t", where)
    counts = {name: _count(obj, name, where) for name in FIELDS[2:]}
    if counts["new_tokens"] > counts["prompt_tokens"]:
        raise TraceError(f"{where}: field 'new_tokens' must not exceed 'prompt_tokens'")
    return Turn(session, t, **counts)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def iter_objects(path: Path) -> Iterator[tuple[int, str, Any]]:
    """(line number, ``path:line``, object) for every non-empty line, streamed; a line that is not
    UTF-8, not JSON (NaN and Infinity included), nested too deep or longer than
    ``MAX_LINE_BYTES`` is a TraceError naming it."""
    with path.open("rb") as f:
        lineno = 0
        while True:
            raw = f.readline(MAX_LINE_BYTES + 1)
            if not raw:
                return
            lineno += 1
            where = f"{path}:{lineno}"
            if len(raw) > MAX_LINE_BYTES:
                raise TraceError(f"{where}: line longer than {MAX_LINE_BYTES:,} bytes")
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise TraceError(f"{where}: not UTF-8 (byte {e.start + 1} of the line)") from None
            if lineno == 1:
                line = line.removeprefix("\ufeff")
            if not line.strip():
                continue
            try:
                obj = json.loads(line, parse_constant=_no_constant)
            except ValueError as e:  # ints past sys.get_int_max_str_digits() too
                raise TraceError(f"{where}: not JSON ({e})") from None
            except RecursionError:  # nested past the parser's depth: no turn is
                raise TraceError(f"{where}: not a turn (JSON nested too deep)") from None
            yield lineno, where, obj


def detect(obj: Any) -> str:
    """The format of a trace whose first turn is ``obj``: bailian with a ``chat_id``,
    mooncake with an ``input_length`` or a ``session_id``, else kvferry's own (whose
    errors then name what is missing)."""
    if isinstance(obj, dict) and "session" not in obj:
        if "chat_id" in obj:
            return "bailian"
        if "input_length" in obj or "session_id" in obj:
            return "mooncake"
    return "kvferry"


def _hash_ids(obj: dict[str, Any], where: str) -> array | None:
    v = obj.get("hash_ids")
    if v is None:
        return None
    if not isinstance(v, list) or not all(
        isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_HASH_ID for x in v
    ):
        raise TraceError(f"{where}: field 'hash_ids' must be a list of integers, 0 to 2**64-1")
    return array("Q", v)


def _common_blocks(a: array, b: array) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    lo, hi = 0, n  # a[:lo] == b[:lo], a[:hi] != b[:hi]
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if a[:mid] == b[:mid]:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True)
class _Last:
    """What a converter keeps of a session's (or chat's) last turn."""

    session: str
    t: float
    prompt: int
    output: int
    hash_ids: array | None


class _Reader:
    def __init__(self, block_tokens: int | None) -> None:
        self.block_tokens = block_tokens
        self.kept_hash_ids = 0
        self.sessions: dict[Any, _Last] = {}

    def keep(self, key: Any, last: _Last, where: str) -> None:
        old = self.sessions.get(key)
        dropped = len(old.hash_ids or ()) if old is not None else 0
        self.kept_hash_ids += len(last.hash_ids or ()) - dropped
        if self.kept_hash_ids > MAX_KEPT_HASH_IDS:
            raise TraceError(
                f"{where}: more than {MAX_KEPT_HASH_IDS:,} hash ids held across the trace's "
                "sessions: cut the trace (a time window, fewer sessions)"
            )
        self.sessions[key] = last

    def new_from_blocks(self, prompt: int, ids: array, prev: array) -> int:
        """The prompt's tokens past its blocks in common with the previous turn's."""
        shared = _common_blocks(ids, prev) * (self.block_tokens or 1)
        return min(prompt, max(0, prompt - shared))


class _Kvferry(_Reader):
    def turn(self, obj: Any, where: str, lineno: int) -> Turn:
        turn = parse_turn(obj, where)
        last = self.sessions.get(turn.session)
        if last is not None and turn.t <= last.t:
            raise TraceError(
                f"{where}: field 't' ({turn.t:g}) must be after the session's previous "
                f"turn ({last.t:g}): a session's turns in increasing time"
            )
        if last is not None:  # one string per session, not one per turn
            turn = Turn(
                last.session, turn.t, turn.prompt_tokens, turn.new_tokens, turn.output_tokens
            )
        self.keep(turn.session, _Last(turn.session, turn.t, 0, 0, None), where)
        return turn


class _Mooncake(_Reader):
    """Mooncake / aiperf rows. A row without ``session_id`` is a session of its own
    (Mooncake's traces: ``input_length`` the whole prompt). In a session, a later row
    whose ``hash_ids`` begin with blocks of the previous row's is a whole prompt too:
    its new tokens are those past the common blocks. Otherwise a later row is what
    aiperf replays it as (its default ``deltas_without_responses``: each row the
    turn's new input, appended to the session's history and answers): the prompt is
    the previous prompt + its answer + ``input_length``, all of it new but the history.
    """

    def turn(self, obj: Any, where: str, lineno: int) -> Turn:
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: a mooncake turn is a JSON object")
        for name in ("input_length", "output_length"):
            if name not in obj:
                raise TraceError(f"{where}: field '{name}' is missing")
        sid = obj.get("session_id")
        if sid is not None and (not isinstance(sid, str) or not sid):
            raise TraceError(f"{where}: field 'session_id' must be a non-empty string")
        length = _count(obj, "input_length", where)
        output = _count(obj, "output_length", where)
        ids = _hash_ids(obj, where)
        last = self.sessions.get(sid) if sid is not None else None
        if "timestamp" in obj:
            t = _seconds(obj["timestamp"], "timestamp", where, 1e3, "milliseconds")
        elif last is not None and "delay" in obj:
            t = last.t + _seconds(obj["delay"], "delay", where, 1e3, "milliseconds")
        elif last is not None:
            raise TraceError(f"{where}: field 'timestamp' or 'delay' is missing")
        else:
            raise TraceError(f"{where}: field 'timestamp' is missing (a session's first turn)")
        if last is None:
            prompt = new = length
        elif ids is not None and last.hash_ids and _common_blocks(ids, last.hash_ids):
            prompt, new = length, self.new_from_blocks(length, ids, last.hash_ids)
        else:
            prompt, new = last.prompt + last.output + length, length
            if prompt > MAX_TOKENS:
                raise TraceError(
                    f"{where}: the session's prompt (its history + 'input_length') passes "
                    f"{MAX_TOKENS:,} tokens"
                )
        if last is not None and t < last.t:
            raise TraceError(
                f"{where}: field 'timestamp' ({t:g} s) is before the session's previous "
                f"turn ({last.t:g} s)"
            )
        session = last.session if last else (sid if sid is not None else f"\0line {lineno}")
        if sid is not None:
            self.keep(sid, _Last(sid, t, prompt, output, ids), where)
        return Turn(session, t, prompt, new, output)


class _Bailian(_Reader):
    """Bailian rows: a session is the root of its ``parent_chat_id`` chain (a turn whose
    parent is not earlier in the file starts its own: the traces are in time order).
    ``input_length`` is the whole prompt; its new tokens are those past the blocks it
    shares with its parent's ``hash_ids``, or without hash ids, past the parent's
    prompt and answer."""

    def turn(self, obj: Any, where: str, lineno: int) -> Turn:
        if not isinstance(obj, dict):
            raise TraceError(f"{where}: a bailian turn is a JSON object")
        for name in ("chat_id", "timestamp", "input_length", "output_length"):
            if name not in obj:
                raise TraceError(f"{where}: field '{name}' is missing")
        chat, parent = obj["chat_id"], obj.get("parent_chat_id", -1)
        for name, v, least in (("chat_id", chat, 0), ("parent_chat_id", parent, -1)):
            if isinstance(v, bool) or not isinstance(v, int) or not least <= v < MAX_HASH_ID:
                raise TraceError(f"{where}: field '{name}' must be an integer >= {least}")
        if chat in self.sessions:
            raise TraceError(f"{where}: field 'chat_id' ({chat}) appears twice")
        t = _seconds(obj["timestamp"], "timestamp", where)
        prompt = _count(obj, "input_length", where)
        output = _count(obj, "output_length", where)
        ids = _hash_ids(obj, where)
        up = self.sessions.get(parent) if parent != chat else None
        if up is None:
            session, new = str(chat), prompt
        else:
            if t < up.t:
                raise TraceError(
                    f"{where}: field 'timestamp' ({t:g}) is before its parent's ({up.t:g})"
                )
            session = up.session
            if ids is not None and up.hash_ids is not None:
                new = self.new_from_blocks(prompt, ids, up.hash_ids)
            else:
                new = min(prompt, max(0, prompt - (up.prompt + up.output)))
        self.keep(chat, _Last(session, t, prompt, output, ids), where)
        return Turn(session, t, prompt, new, output)


def read_trace(path: Path, fmt: str = "auto", block_tokens: int | None = None) -> list[Turn]:
    """The turns of the trace at ``path`` (``fmt``: one of FORMATS or "auto", detected
    from its first turn), sorted by time, the first at t = 0. ``block_tokens``: the
    tokens per hash id (default: the format's own, MOONCAKE_BLOCK_TOKENS or
    BAILIAN_BLOCK_TOKENS). Streams the file; past any bound, a TraceError naming the
    line."""
    if fmt not in (*FORMATS, "auto"):
        raise TraceError(f"{path}: format '{fmt}': one of {', '.join(FORMATS)} or auto")
    if block_tokens is not None and not 1 <= block_tokens <= MAX_TOKENS:
        raise TraceError(f"block tokens {block_tokens}: 1 to {MAX_TOKENS:,}")
    turns: list[Turn] = []
    reader: _Reader | None = None
    lo, hi = math.inf, -math.inf
    for lineno, where, obj in iter_objects(path):
        if reader is None:
            kind = detect(obj) if fmt == "auto" else fmt
            default = {"mooncake": MOONCAKE_BLOCK_TOKENS, "bailian": BAILIAN_BLOCK_TOKENS}
            cls = {"kvferry": _Kvferry, "mooncake": _Mooncake, "bailian": _Bailian}[kind]
            reader = cls(block_tokens or default.get(kind))
        if len(turns) >= MAX_TURNS:
            raise TraceError(
                f"{where}: more than {MAX_TURNS:,} turns: cut the trace (a time window, "
                "fewer sessions)"
            )
        turn = reader.turn(obj, where, lineno)
        lo, hi = min(lo, turn.t), max(hi, turn.t)
        if hi - lo > MAX_SPAN_SECONDS:
            raise TraceError(
                f"{where}: the trace spans more than {MAX_SPAN_SECONDS:g} s "
                f"({MAX_SPAN_SECONDS / 86400:g} days) from its first turn to its last"
            )
        turns.append(turn)
    if turns and lo > 0:  # the first turn at 0: the origin costs nothing downstream
        for i, x in enumerate(turns):
            turns[i] = Turn(x.session, x.t - lo, x.prompt_tokens, x.new_tokens, x.output_tokens)
    turns.sort(key=lambda x: x.t)
    return turns


def write_trace(turns: Iterable[Turn], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for x in turns:
            row = {"session": x.session, "t": round(x.t, 3)}
            row |= {n: getattr(x, n) for n in FIELDS[2:]}
            f.write(json.dumps(row) + "\n")
