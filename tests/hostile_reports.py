"""Generated residency report bodies, shared by the unit tier (against
``kvferry_wire.report.decode`` and the endpoint in process) and the cluster tier
(against the real operator): a good report with fields replaced by junk of every
type (lone surrogates, text that is no UTF-8, huge strings, wrong types) or removed,
junk bytes, and nesting far past any parser's stack, at the top and inside a field.

One seeded generator (``report_body``) makes both: ``report_corpus`` a fixed list of
exactly ``count`` bodies (the unit tier: the same bodies every run), and
``report_bodies`` a hypothesis strategy drawing its seed (the cluster tier: shrinks
to the body that failed). Every junk value is a fresh copy: a body's later mutation
must never reach a value shared with the next body (shared lists and dicts grew into
themselves and the generator failed with "Circular reference detected")."""

from __future__ import annotations

import copy
import json
import random
from typing import Any

from hypothesis import strategies as st

# Nesting depths: 50 stays within every decoder's stack; 1,000 and more do not
# (msgspec raised RecursionError at 1,000 and the endpoint answered 500).
DEEP = (1_000, 10_000, 100_000)


def report_leaves(raw: Any, path: tuple = ()) -> list[tuple]:
    out = [path]
    if isinstance(raw, dict):
        for k, v in raw.items():
            out += report_leaves(v, (*path, k))
    return out


def nested(depth: int) -> Any:
    value: Any = 1
    for _ in range(depth):
        value = [value]
    return value


def _deep_mark(depth: int) -> str:
    """A string put where a deep value goes; replaced in the dumped bytes, since
    json.dumps itself cannot write values nested past its stack."""
    return f"\x00deep:{depth}\x00"


# Bytes that are no UTF-8, put inside a string of the dumped report.
_NOT_UTF8 = "\x00not-utf8\x00"


def _splice(text: str) -> bytes:
    for depth in DEEP:
        text = text.replace(json.dumps(_deep_mark(depth)), "[" * depth + "1" + "]" * depth)
    return text.encode().replace(json.dumps(_NOT_UTF8)[1:-1].encode(), b"\xff\xfe\xc3")


# Fixed junk; copied on every use (see the module docstring).
JUNK: tuple[Any, ...] = (
    None,
    -1,
    -0.5,
    2**64,
    -(2**63) - 1,
    1e308,
    "x" * 2000,
    "",
    True,
    [],
    {},
    {"x": 1},
    nested(50),
    [1, "two", None],
)


def text(rng: random.Random, size: int) -> str:
    """Code points of every plane, lone surrogates (U+D800..U+DFFF) often."""
    out = []
    for _ in range(size):
        kind = rng.randrange(4)
        if kind == 0:
            out.append(chr(rng.randrange(0xD800, 0xE000)))
        elif kind == 1:
            out.append(chr(rng.randrange(0x20, 0x7F)))
        else:
            c = rng.randrange(0x110000)
            out.append(chr(c))
    return "".join(out)


def junk(rng: random.Random) -> Any:
    """One value of any JSON type, never shared with another body."""
    kind = rng.randrange(10)
    if kind == 0:
        return copy.deepcopy(rng.choice(JUNK))
    if kind == 1:
        return _deep_mark(rng.choice(DEEP))
    if kind == 2:
        return rng.randint(-5, 2**60)
    if kind == 3:
        return rng.choice([rng.uniform(-1e12, 1e12), 0.0, -0.0, 5e-324, 1.7e308])
    if kind == 4:
        return text(rng, rng.randrange(30))
    if kind == 5:
        return _NOT_UTF8
    if kind == 6:
        return "y" * rng.choice([10_000, 100_000, 300_000])  # near and past the size cap
    if kind == 7:
        return {text(rng, rng.randrange(12)): rng.randint(-2, 5) for _ in range(rng.randrange(5))}
    if kind == 8:
        return [junk(rng) for _ in range(rng.randrange(4))]
    return str(rng.randint(-5, 10))  # a number as a string: no lax coercion in the decoder


def report_body(rng: random.Random, base: dict[str, Any]) -> bytes:
    """``base`` (a good report, decoded) mutated, or junk in its place."""
    choice = rng.randrange(20)
    if choice == 0:
        return rng.randbytes(rng.randrange(200))
    if choice == 1:
        depth = rng.choice([100, *DEEP])
        return b"[" * depth + b"1" + b"]" * depth
    raw = copy.deepcopy(base)
    paths = report_leaves(raw)[1:]
    if rng.randrange(10) == 0:
        paths.append(("x-unknown-field",))  # unknown fields are skipped, deep or not
    for _ in range(rng.randint(1, 3)):
        path = rng.choice(paths)
        node = raw
        for part in path[:-1]:
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, dict):
            continue
        if rng.randrange(4) == 0:
            node.pop(path[-1], None)
        else:
            node[path[-1]] = junk(rng)
    return _splice(json.dumps(raw))


def report_corpus(base: dict[str, Any], count: int = 1000, seed: int = 20) -> list[bytes]:
    """Exactly ``count`` bodies, the same ones for the same seed."""
    rng = random.Random(seed)
    return [report_body(rng, base) for _ in range(count)]


def report_bodies(base: dict[str, Any]) -> st.SearchStrategy[bytes]:
    """The same generator as a hypothesis strategy (its seed drawn and shrunk)."""
    return st.randoms(use_true_random=False).map(lambda rng: report_body(rng, base))
