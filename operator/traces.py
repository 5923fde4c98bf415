"""Session traces: one turn per JSON line (``session``, ``t`` seconds, ``prompt_tokens``,
``new_tokens``, ``output_tokens``), as ``kvferry-operator what-if`` and
``make bench-eviction`` read them (docs/what-if.md). A bad line is an error naming the
line and the field; nothing is guessed."""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

FIELDS = ("session", "t", "prompt_tokens", "new_tokens", "output_tokens")


@dataclass(frozen=True)
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
    t = obj["t"]
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
        raise TraceError(f"{where}: field 't' must be a finite number of seconds >= 0")
    counts = {}
    for name in FIELDS[2:]:
        v = obj[name]
        if isinstance(v, bool) or not isinstance(v, int) or v < 0:
            raise TraceError(f"{where}: field '{name}' must be an integer >= 0")
        counts[name] = v
    if counts["new_tokens"] > counts["prompt_tokens"]:
        raise TraceError(f"{where}: field 'new_tokens' must not exceed 'prompt_tokens'")
    return Turn(session, float(t), **counts)


def read_trace(path: Path) -> list[Turn]:
    turns: list[Turn] = []
    last: dict[str, float] = {}
    with path.open(encoding="utf-8") as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise TraceError(f"{where}: not JSON ({e})") from None
            except RecursionError:  # nested past the parser's depth: no turn is
                raise TraceError(f"{where}: not a turn (JSON nested too deep)") from None
            turn = parse_turn(obj, where)
            if turn.session in last and turn.t <= last[turn.session]:
                raise TraceError(
                    f"{where}: field 't' ({turn.t:g}) must be after the session's previous "
                    f"turn ({last[turn.session]:g}): a session's turns in increasing time"
                )
            last[turn.session] = turn.t
            turns.append(turn)
    return sorted(turns, key=lambda x: x.t)


def write_trace(turns: Iterable[Turn], path: Path) -> None:
    with path.open("w", encoding="utf-8") as f:
        for x in turns:
            row = {"session": x.session, "t": round(x.t, 3)}
            row |= {n: getattr(x, n) for n in FIELDS[2:]}
            f.write(json.dumps(row) + "\n")
