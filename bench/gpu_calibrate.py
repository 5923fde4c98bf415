"""GPU prices for the eviction simulator: prefill and pull seconds per token of common
model shapes on the accelerator this runs on, with PyTorch alone (no vLLM, random
weights).

``python -m bench.gpu_calibrate --out FILE [--device cuda|cpu] [--shapes 8b,70b-tp8,moe]
[--model 8b] [--quick] [--network-gbps G] [--pull-over host|hbm]``
(``make bench-gpu-calibrate``). ``bench/eviction.py --costs FILE`` reads its
``results.calibration`` (the format of a ``bench.eviction_model`` result), and
``kvferry-operator what-if --status FILE`` its ``status`` (a KVCacheStatus's
``transfer`` and ``costs`` sections).

What it measures, for each shape (``SHAPES``; one tensor-parallel rank's share where
``tp`` > 1):

- **prefill seconds per token**: one decoder layer (RMSNorm, QKV projection, rotary,
  causal ``scaled_dot_product_attention`` with the KV heads expanded to the query heads,
  output projection, RMSNorm, SwiGLU MLP or a top-k mixture of experts) timed at a
  few prompt lengths, times the layer count; ``time = a + b x tokens`` fitted by least
  squares, ``b`` the price of a recomputed token, the fit's worst relative residual
  beside it (attention's quadratic term shows there). Left out: embeddings, the LM head,
  a TP rank's all-reduces, a fused MoE kernel (the experts run one matmul pair each,
  or ``torch._grouped_mm`` where it works), vLLM's own kernels. So ``b`` prices the
  layer arithmetic on this device, not a serving engine's measured prefill;
- **KV bytes per token**: the formula, ``2 x layers x kv_heads x head_dim x bytes``
  (per rank under TP), of the real shape also in ``--quick``;
- **copy bandwidth**: torch copies of a 1 GiB tensor HBM -> HBM, HBM -> pinned host and
  pinned host -> HBM, timed with CUDA events (bytes moved once; a device copy reads and
  writes each). The pull seconds per token is bytes per token / bandwidth: a
  device-local copy bound, not NIXL over a network. ``--pull-over host`` (default) uses
  the slower direction of the host bus, ``hbm`` the device copy; ``--network-gbps G``
  prices the pull over a link of G gigabits per second instead (a NIC's rating: 400 is
  50 GB/s). A pull's fixed latency is not priced.

``--quick`` (for testing the script, not prices): shorter prompts, fewer iterations, a
64 MiB copy, and every timed layer 8x narrower (hidden size, heads, MLP, experts); the
layer counts and the KV bytes stay the real shape's. The output says so.

Standalone on purpose: it runs in whatever Python has torch (a GPU machine's, the
engine venv), where kvferry itself is not installed, so it imports nothing of
kvferry's and writes ``bench.common.Result``'s fields itself.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = ROOT / "docs" / "performance" / "gpu-calibrate.json"

BLOCK_TOKENS = 16  # vLLM's default block size on GPUs
PROMPT_TOKENS = (512, 2048, 8192)
QUICK_PROMPT_TOKENS = (64, 256, 1024)
QUICK_SCALE = 8
COPY_BYTES = 1 << 30
QUICK_COPY_BYTES = 64 << 20
DTYPES = {"bf16": 2, "fp16": 2, "fp32": 4}


@dataclass(frozen=True)
class Shape:
    """A decoder's dimensions as one rank holds them (heads and MLP already divided by
    ``tp``; the hidden size is the residual stream's, which TP does not divide)."""

    name: str
    title: str
    layers: int
    hidden: int
    q_heads: int
    kv_heads: int
    head_dim: int
    mlp: int  # the dense MLP's intermediate size, or one expert's
    experts: int = 0
    top_k: int = 0
    tp: int = 1

    def kv_bytes_per_token(self, kv_bytes: int) -> int:
        """K and V of every layer for one token on this rank."""
        return 2 * self.layers * self.kv_heads * self.head_dim * kv_bytes

    def scaled(self, factor: int) -> Shape:
        """The same layer ``factor`` times narrower (for ``--quick``); layers unchanged."""
        kv = max(1, self.kv_heads // factor)
        q = max(kv, self.q_heads // factor // kv * kv)
        return replace(
            self,
            hidden=max(64, self.hidden // factor),
            q_heads=q,
            kv_heads=kv,
            mlp=max(32, self.mlp // factor),
            experts=self.experts // factor if self.experts else 0,
            top_k=max(2, self.top_k // factor) if self.experts else 0,
        )


SHAPES: dict[str, Shape] = {
    s.name: s
    for s in (
        Shape("8b", "Llama-3-8B-like", 32, 4096, 32, 8, 128, 14336),
        # One rank of TP 8: 64/8 query heads, 8/8 KV heads, MLP 28672/8.
        Shape("70b-tp8", "Llama-3-70B, one rank of TP 8", 80, 8192, 8, 1, 128, 3584, tp=8),
        Shape(
            "moe",
            "Qwen3-30B-A3B-like MoE (128 experts, top 8)",
            48,
            2048,
            32,
            4,
            128,
            768,
            experts=128,
            top_k=8,
        ),
    )
}


def say(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def table(head: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    def cell(v: Any) -> str:
        if v is None:
            return "-"
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 100 else f"{v:.0f}"
        return str(v)

    body = [[cell(c) for c in r] for r in rows]
    widths = [max([len(h)] + [len(b[i]) for b in body]) for i, h in enumerate(head)]
    lines = ["  ".join(h.rjust(w) for h, w in zip(head, widths, strict=True))]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(c.rjust(w) for c, w in zip(b, widths, strict=True)) for b in body]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- fit
@dataclass(frozen=True)
class Fit:
    fixed_s: float  # a
    per_token_s: float  # b
    worst_relative_residual: float

    def at(self, tokens: float) -> float:
        return self.fixed_s + self.per_token_s * tokens


def fit_line(xs: Sequence[float], ys: Sequence[float]) -> Fit:
    """Least squares ``y = a + b x``, and the largest ``|fit - y| / y`` over the points."""
    if len(xs) != len(ys) or len(xs) < 2:
        raise ValueError("a fit needs two points or more")
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    if sxx == 0:
        raise ValueError("a fit needs two different prompt lengths")
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    a = my - b * mx
    worst = max(abs(a + b * x - y) / y for x, y in zip(xs, ys, strict=True))
    return Fit(a, b, worst)


# ----------------------------------------------------------------------------- torch
def _torch() -> Any:
    try:
        import torch
    except ImportError as e:  # pragma: no cover - said plainly
        raise SystemExit(
            "bench.gpu_calibrate needs PyTorch: run it with a Python that has torch (a GPU "
            "machine's python3, or the engine venv's: hack/engine-env.sh prints it)"
        ) from e
    return torch


def timed(fn: Callable[[], Any], device: str, warmup: int, iters: int) -> float:
    """Median seconds of ``iters`` calls after ``warmup`` (CUDA events on a GPU)."""
    torch = _torch()
    for _ in range(warmup):
        fn()
    if device == "cuda":
        torch.cuda.synchronize()
        pairs = []
        for _ in range(iters):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            pairs.append((start, end))
        torch.cuda.synchronize()
        return statistics.median(s.elapsed_time(e) / 1e3 for s, e in pairs)
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


class Layer:
    """One decoder layer of ``shape`` with random weights (``F.linear`` layout)."""

    def __init__(self, shape: Shape, device: str, dtype: Any, max_tokens: int) -> None:
        torch = _torch()
        self.torch = torch
        self.shape = shape
        s, d = shape, shape.head_dim
        gen = torch.Generator(device=device).manual_seed(0)

        def w(*size: int) -> Any:
            return torch.randn(*size, device=device, dtype=dtype, generator=gen) * 0.02

        self.ln1 = torch.ones(s.hidden, device=device, dtype=dtype)
        self.ln2 = torch.ones(s.hidden, device=device, dtype=dtype)
        self.w_qkv = w((s.q_heads + 2 * s.kv_heads) * d, s.hidden)
        self.w_o = w(s.hidden, s.q_heads * d)
        if s.experts:
            self.w_router = w(s.experts, s.hidden)
            self.w_gate_up = w(s.experts, 2 * s.mlp, s.hidden)
            self.w_down = w(s.experts, s.hidden, s.mlp)
        else:
            self.w_gate_up = w(2 * s.mlp, s.hidden)
            self.w_down = w(s.hidden, s.mlp)
        pos = torch.arange(max_tokens, device=device, dtype=torch.float32)
        inv = 1.0 / (500000.0 ** (torch.arange(0, d, 2, device=device, dtype=torch.float32) / d))
        ang = torch.outer(pos, inv)
        self.cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)  # (T, d)
        self.sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
        self.moe_kernel = "none"
        if s.experts:
            self.moe_kernel = "grouped_mm" if self._grouped_mm_agrees(device, dtype) else "loop"

    # -- pieces
    def _norm(self, x: Any, w: Any) -> Any:
        F = self.torch.nn.functional
        if hasattr(F, "rms_norm"):
            return F.rms_norm(x, (x.shape[-1],), w, 1e-5)
        var = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * self.torch.rsqrt(var + 1e-5)).to(x.dtype) * w

    def _rope(self, x: Any, cos: Any, sin: Any) -> Any:  # x: (T, H, d)
        half = x.shape[-1] // 2
        rot = self.torch.cat([-x[..., half:], x[..., :half]], -1)
        return x * cos[:, None, :] + rot * sin[:, None, :]

    def _dense(self, h: Any) -> Any:
        F = self.torch.nn.functional
        g, u = F.linear(h, self.w_gate_up).chunk(2, -1)
        return F.linear(F.silu(g) * u, self.w_down)

    def _route(self, h: Any) -> tuple[Any, Any, Any, Any]:
        """Tokens sorted by expert: (their rows of h, their gate weights, each row's
        token, the rows per expert)."""
        torch, k = self.torch, self.shape.top_k
        probs = torch.nn.functional.linear(h, self.w_router).float().softmax(-1)
        weights, idx = torch.topk(probs, k, dim=-1)
        weights = (weights / weights.sum(-1, keepdim=True)).to(h.dtype)
        flat = idx.flatten()
        order = flat.argsort(stable=True)
        token = order // k
        counts = torch.bincount(flat, minlength=self.shape.experts)
        return h[token], weights.flatten()[order], token, counts

    def _experts_loop(self, xs: Any, counts: Any) -> Any:
        F = self.torch.nn.functional
        out = self.torch.empty_like(xs)
        start = 0
        for e, n in enumerate(counts.tolist()):
            if n:
                g, u = F.linear(xs[start : start + n], self.w_gate_up[e]).chunk(2, -1)
                out[start : start + n] = F.linear(F.silu(g) * u, self.w_down[e])
                start += n
        return out

    def _experts_grouped(self, xs: Any, counts: Any) -> Any:
        torch = self.torch
        offs = counts.cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(xs, self.w_gate_up.transpose(-2, -1), offs=offs)
        g, u = gu.chunk(2, -1)
        act = torch.nn.functional.silu(g) * u
        return torch._grouped_mm(act, self.w_down.transpose(-2, -1), offs=offs)

    def _grouped_mm_agrees(self, device: str, dtype: Any) -> bool:
        """``torch._grouped_mm`` where this torch and device run it and it gives the
        loop's answer; the per-expert loop otherwise."""
        torch = self.torch
        if not hasattr(torch, "_grouped_mm"):
            return False
        try:
            h = torch.randn(64, self.shape.hidden, device=device, dtype=dtype)
            xs, _, _, counts = self._route(h)
            a = self._experts_grouped(xs, counts).float()
            b = self._experts_loop(xs, counts).float()
            return bool(torch.allclose(a, b, rtol=0.05, atol=0.05 * float(b.abs().max())))
        except Exception:
            return False

    def _moe(self, h: Any) -> Any:
        xs, gates, token, counts = self._route(h)
        out = None
        if self.moe_kernel == "grouped_mm":
            try:
                out = self._experts_grouped(xs, counts)
            except RuntimeError:  # a size the check did not see; warm-up finds it
                self.moe_kernel = "loop"
        if out is None:
            out = self._experts_loop(xs, counts)
        y = self.torch.zeros_like(h)
        return y.index_add_(0, token, out * gates[:, None])

    def forward(self, x: Any) -> Any:
        torch, s, d = self.torch, self.shape, self.shape.head_dim
        F = torch.nn.functional
        t = x.shape[0]
        qkv = F.linear(self._norm(x, self.ln1), self.w_qkv)
        q, k, v = qkv.split([s.q_heads * d, s.kv_heads * d, s.kv_heads * d], -1)
        cos, sin = self.cos[:t], self.sin[:t]
        q = self._rope(q.view(t, s.q_heads, d), cos, sin)
        k = self._rope(k.view(t, s.kv_heads, d), cos, sin)
        v = v.view(t, s.kv_heads, d)
        group = s.q_heads // s.kv_heads
        if group > 1:
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        q, k, v = (z.transpose(0, 1).unsqueeze(0) for z in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(o.squeeze(0).transpose(0, 1).reshape(t, s.q_heads * d), self.w_o)
        h = self._norm(x, self.ln2)
        return x + (self._moe(h) if s.experts else self._dense(h))


def prefill(
    shape: Shape,
    timed_shape: Shape,
    device: str,
    dtype_name: str,
    prompts: Sequence[int],
    warmup: int,
    iters: int,
) -> dict[str, Any]:
    """One layer of ``timed_shape`` timed at each prompt length, scaled by the layers."""
    torch = _torch()
    dtype = getattr(torch, {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}[dtype_name])
    layer = Layer(timed_shape, device, dtype, max(prompts))
    layer_s = []
    with torch.inference_mode():
        for n in prompts:
            x = torch.randn(n, timed_shape.hidden, device=device, dtype=dtype)
            layer_s.append(timed(lambda x=x, f=layer.forward: f(x), device, warmup, iters))
            del x
    total = [t * shape.layers for t in layer_s]
    fit = fit_line([float(n) for n in prompts], total)
    moe_kernel = layer.moe_kernel if timed_shape.experts else None
    del layer
    if device == "cuda":
        torch.cuda.empty_cache()
    return {
        "layerSeconds": layer_s,
        "prefillSeconds": total,
        "secondsPerTokenAt": [t / n for t, n in zip(total, prompts, strict=True)],
        "fit": {
            "fixedSeconds": fit.fixed_s,
            "secondsPerToken": fit.per_token_s,
            "worstRelativeResidual": fit.worst_relative_residual,
        },
        "moeKernel": moe_kernel,
    }


def bandwidths(device: str, nbytes: int, warmup: int, iters: int) -> dict[str, float]:
    """Bytes per second of one copy of ``nbytes`` (counted once) on each path. On a CPU
    there is one memory: every path is the same DRAM memcpy."""
    torch = _torch()
    out: dict[str, float] = {}
    if device == "cuda":
        src = torch.ones(nbytes, dtype=torch.uint8, device="cuda")
        dst = torch.empty_like(src)
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        paths = {
            "hbmToHbm": lambda: dst.copy_(src),
            "hbmToHost": lambda: host.copy_(src, non_blocking=True),
            "hostToHbm": lambda: dst.copy_(host, non_blocking=True),
        }
        for name, fn in paths.items():
            out[name] = nbytes / timed(fn, device, warmup, iters)
        del src, dst, host
        torch.cuda.empty_cache()
        return out
    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    bw = nbytes / timed(lambda: dst.copy_(src), device, warmup, iters)
    return {"hbmToHbm": bw, "hbmToHost": bw, "hostToHbm": bw}


def pull_bandwidth(bw: dict[str, float], pull_over: str, network_gbps: float | None) -> float:
    """Bytes per second a pull is priced at."""
    if network_gbps:
        return network_gbps * 1e9 / 8
    if pull_over == "hbm":
        return bw["hbmToHbm"]
    return min(bw["hbmToHost"], bw["hostToHbm"])


# ----------------------------------------------------------------------------- run
def _machine() -> dict[str, Any]:
    def first(path: str, key: str) -> str | None:
        try:
            for line in Path(path).read_text().splitlines():
                if line.startswith(key):
                    return line.split(":", 1)[1].strip()
        except OSError:
            return None
        return None

    mem = first("/proc/meminfo", "MemTotal")
    return {
        "cpu": first("/proc/cpuinfo", "model name") or platform.processor() or "?",
        "cores": os.cpu_count(),
        "memoryGiB": round(int(mem.split()[0]) / 2**20, 1) if mem else None,
        "kernel": platform.release(),
        "python": platform.python_version(),
        "loadAverageAtStart": [round(x, 2) for x in os.getloadavg()],
    }


def _git_head() -> str:
    try:
        res = subprocess.run(
            ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return res.stdout.strip() or "?"
    except (OSError, subprocess.TimeoutExpired):
        return "?"


def _command(argv: Sequence[str] | None) -> str:
    args = list(sys.argv[1:] if argv is None else argv)
    return " ".join(shlex.quote(a) for a in ["python", "-m", "bench.gpu_calibrate", *args])


def calibrate(args: argparse.Namespace) -> dict[str, Any]:
    """Every figure, as the JSON ``--out`` gets (``bench.common.Result``'s fields)."""
    torch = _torch()
    started = time.monotonic()
    device = args.device
    if device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--device cuda: torch sees no CUDA device (--device cpu to test)")
    quick = args.quick
    prompts = tuple(args.prompt_tokens or (QUICK_PROMPT_TOKENS if quick else PROMPT_TOKENS))
    if device == "cuda":
        warmup, iters = (1, 3) if quick else (3, 10)
    else:
        warmup, iters = (1, 5)
        if quick:
            # One thread: on a loaded CPU two threads wait on each other (and the
            # prompt lengths' times stop growing with the tokens).
            torch.set_num_threads(1)
    copy_bytes = QUICK_COPY_BYTES if quick else COPY_BYTES
    device_name = (
        torch.cuda.get_device_name(0) if device == "cuda" else (_machine()["cpu"] + " (CPU)")
    )
    note = (
        f"--quick on {device}: every timed layer {QUICK_SCALE}x narrower, short prompts, few "
        "iterations" + (", one thread" if device == "cpu" else "") + "; for testing the "
        "script, NOT prices"
        if quick
        else (
            "PyTorch layer arithmetic with random weights (no vLLM); pull = KV bytes / a "
            "device-local copy bandwidth, not NIXL over a network"
            + (f" (priced over a {args.network_gbps:g} Gb/s link)" if args.network_gbps else "")
        )
    )
    say(f"device {device_name}, torch {torch.__version__}, {args.dtype}; {note}")

    bw = bandwidths(device, copy_bytes, warmup, iters)
    pull_bw = pull_bandwidth(bw, args.pull_over, args.network_gbps)
    pull_over = "network" if args.network_gbps else args.pull_over
    say(
        "copy GB/s: "
        + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items())
        + f"; pulls priced at {pull_bw / 1e9:.2f} GB/s ({pull_over})"
    )

    shapes: dict[str, Any] = {}
    for name in args.shapes:
        shape = SHAPES[name]
        timed_shape = shape.scaled(QUICK_SCALE) if quick else shape
        say(f"{name}: {shape.title}; one layer at {', '.join(map(str, prompts))} tokens")
        p = prefill(shape, timed_shape, device, args.dtype, prompts, warmup, iters)
        bpt = shape.kv_bytes_per_token(args.kv_bytes)
        pulls = {
            "hbm": bpt / bw["hbmToHbm"],
            "host": bpt / min(bw["hbmToHost"], bw["hostToHbm"]),
        }
        if args.network_gbps:
            pulls["network"] = bpt / (args.network_gbps * 1e9 / 8)
        shapes[name] = {
            "title": shape.title,
            "shape": asdict(shape),
            "timedShape": asdict(timed_shape),
            "promptTokens": list(prompts),
            **p,
            "recomputeSecondsPerToken": p["fit"]["secondsPerToken"],
            "bytesPerToken": bpt,
            "blockTokens": BLOCK_TOKENS,
            "pullSecondsPerToken": bpt / pull_bw,
            "pullSecondsPerTokenBy": pulls,
        }

    chosen = shapes[args.model]
    recompute, pull = chosen["recomputeSecondsPerToken"], chosen["pullSecondsPerToken"]
    calibration = {
        "model": args.model,
        "recomputeSecondsPerToken": recompute,
        "pullSecondsPerToken": pull,
        "bytesPerToken": chosen["bytesPerToken"],
        "blockTokens": BLOCK_TOKENS,
        "pullOver": pull_over,
        "pullBytesPerSecond": pull_bw,
        "quick": quick,
    }
    results = {
        "device": device_name,
        "torch": torch.__version__,
        "quick": quick,
        "note": note,
        "calibration": calibration,
        "bandwidthBytesPerSecond": bw,
        "shapes": shapes,
        "whatIfArgs": [
            "--recompute-us-per-token",
            f"{recompute * 1e6:.6g}",
            "--bytes-per-token",
            str(chosen["bytesPerToken"]),
            "--bandwidth-gbps",  # what-if's flag is GB/s
            f"{pull_bw / 1e9:.6g}",
        ],
    }
    return {
        "name": "gpu-calibrate",
        "command": _command(args.argv),
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": _machine(),
        "versions": {
            "kvferry": _git_head(),
            "torch": torch.__version__,
            "cuda": getattr(torch.version, "cuda", None),
        },
        "settings": {
            "device": device,
            "dtype": args.dtype,
            "kvBytes": args.kv_bytes,
            "quick": quick,
            "quickScale": QUICK_SCALE if quick else 1,
            "shapes": list(args.shapes),
            "model": args.model,
            "promptTokens": list(prompts),
            "warmup": warmup,
            "iterations": iters,
            "copyBytes": copy_bytes,
            "pullOver": pull_over,
            "networkGbps": args.network_gbps,
        },
        "results": results,
        # The chosen shape's figures as a KVCacheStatus holds them, for
        # `kvferry-operator what-if --status FILE`.
        "status": {
            "transfer": {
                "bytesPerToken": chosen["bytesPerToken"],
                "gigabytesPerSecond": pull_bw / 1e9,
            },
            "costs": {"recomputeSecondsPerToken": recompute, "pullSecondsPerToken": pull},
        },
        "targets": [],
        "seconds": time.monotonic() - started,
    }


def report(data: dict[str, Any]) -> str:
    r = data["results"]
    rows = []
    for name, s in r["shapes"].items():
        fit = s["fit"]
        rows.append(
            [
                name,
                s["shape"]["layers"],
                f"{s['prefillSeconds'][-1] * 1e3:.1f}",
                fit["secondsPerToken"] * 1e6,
                fit["fixedSeconds"] * 1e3,
                f"{fit['worstRelativeResidual']:.1%}",
                s["bytesPerToken"],
                s["pullSecondsPerToken"] * 1e6,
                s.get("moeKernel") or "-",
            ]
        )
    head = [
        "shape",
        "layers",
        f"prefill {r['shapes'][next(iter(r['shapes']))]['promptTokens'][-1]} ms",
        "us/token",
        "fixed ms",
        "worst resid",
        "KV B/token",
        "pull us/token",
        "moe",
    ]
    c = r["calibration"]
    return (
        table(head, rows)
        + f"\n\ncalibration ({c['model']}): recompute {c['recomputeSecondsPerToken'] * 1e6:.4g} "
        f"us/token, pull {c['pullSecondsPerToken'] * 1e6:.4g} us/token over {c['pullOver']} "
        f"({c['pullBytesPerSecond'] / 1e9:.2f} GB/s), {c['bytesPerToken']:,} B/token, "
        f"{c['blockTokens']}-token blocks"
        + ("\nQUICK: for testing the script, not prices" if r["quick"] else "")
    )


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python -m bench.gpu_calibrate", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the JSON file to write")
    p.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    p.add_argument(
        "--shapes",
        default=",".join(SHAPES),
        help=f"comma-separated, of {', '.join(SHAPES)} (default all)",
    )
    p.add_argument("--model", default="8b", help="the shape results.calibration prices")
    p.add_argument("--quick", action="store_true", help="tiny and short: tests the script")
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    p.add_argument("--kv-bytes", type=int, default=2, help="bytes per KV element (1: fp8 KV)")
    p.add_argument(
        "--pull-over",
        choices=("host", "hbm"),
        default="host",
        help="the copy a pull is priced at: host (slower direction of HBM<->pinned host) "
        "or hbm (HBM->HBM)",
    )
    p.add_argument(
        "--network-gbps",
        type=float,
        help="price a pull over a link of this many gigabits/s instead (400 = 50 GB/s)",
    )
    p.add_argument(
        "--prompt-tokens",
        type=lambda v: [int(x) for x in v.split(",")],
        help="comma-separated prompt lengths (default 512,2048,8192; --quick 64,256,1024)",
    )
    args = p.parse_args(argv)
    args.argv = argv
    args.shapes = [s.strip() for s in args.shapes.split(",") if s.strip()]
    unknown = [s for s in args.shapes if s not in SHAPES]
    if unknown:
        p.error(f"--shapes: unknown {', '.join(unknown)} (known: {', '.join(SHAPES)})")
    if args.model not in SHAPES:
        p.error(f"--model: unknown {args.model} (known: {', '.join(SHAPES)})")
    if args.model not in args.shapes:
        args.shapes.append(args.model)
    if args.network_gbps is not None and args.network_gbps <= 0:
        p.error("--network-gbps: a rate > 0")
    if args.prompt_tokens is not None and (
        len(set(args.prompt_tokens)) < 2 or min(args.prompt_tokens) < 1
    ):
        p.error("--prompt-tokens: two different lengths or more, each >= 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse(argv)
    data = calibrate(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data["machine"]["loadAverageAtEnd"] = [round(x, 2) for x in os.getloadavg()]
    args.out.write_text(json.dumps(data, indent=2) + "\n")
    print(report(data))
    say(f"wrote {args.out} ({data['seconds']:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
