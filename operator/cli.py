"""``kvferry-operator``: run the operator, render a manifest offline, or say what reuse
would do for a trace of sessions (``what-if``)."""

from __future__ import annotations

import argparse
import sys
from typing import Any, TextIO

import yaml

from kvferry_wire import extras

from . import api


class _Dumper(yaml.SafeDumper):
    """Multi-line strings (ConfigMap data) as readable ``|`` blocks."""


def _str(dumper: yaml.SafeDumper, value: str) -> yaml.ScalarNode:
    style = "|" if "\n" in value else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", value, style=style)


_Dumper.add_representer(str, _str)


def dump_yaml(objects: list[dict[str, Any]], out: TextIO) -> None:
    yaml.dump_all(objects, out, Dumper=_Dumper, sort_keys=False, width=120)


def render_documents(stream: TextIO) -> tuple[list[dict[str, Any]], list[str]]:
    """Children of every DisaggregatedServer in ``stream``, and the errors found."""
    from . import hostpaths, render, validation  # the operator extra: checked in main()
    from . import settings as operator_settings

    # The operator's own refusals too (a hostPath, what a podTemplate may not set),
    # under the settings it reads (KVFERRY_HOST_PATH_PREFIXES,
    # KVFERRY_POD_TEMPLATE_ALLOW; none allowed when unset): what this prints, the
    # operator applies.
    ours = operator_settings.from_env()
    out: list[dict[str, Any]] = []
    errors: list[str] = []
    for i, doc in enumerate(yaml.safe_load_all(stream)):
        if not doc:
            continue
        if doc.get("apiVersion") != api.API_VERSION or doc.get("kind") != api.SERVER_KIND:
            errors.append(
                f"document {i}: expected apiVersion {api.API_VERSION} and kind "
                f"{api.SERVER_KIND}, got {doc.get('apiVersion')}/{doc.get('kind')}"
            )
            continue
        name = (doc.get("metadata") or {}).get("name", f"document {i}")
        # What the API server would store: without the nulls it drops.
        doc = validation.prune_nulls(doc)
        problems = validation.validate(doc)
        if problems:
            errors += [f"{api.SERVER_KIND} {name}: {p}" for p in problems]
            continue
        server = api.parse_server(doc)
        refused = hostpaths.refusal(server, ours.host_path_prefixes) or (
            ours.pod_template_refusal(server)
        )
        if refused:
            errors.append(f"{api.SERVER_KIND} {name}: {refused}")
            continue
        out += render.render(server)
    return out, errors


def _cmd_render(args: argparse.Namespace) -> int:
    with open(args.file) if args.file != "-" else sys.stdin as f:
        objects, errors = render_documents(f)
    for err in errors:
        print(f"error: {err}", file=sys.stderr)
    if errors:
        return 2
    dump_yaml(objects, sys.stdout)
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    from . import main as operator_main  # kopf is only needed here

    return operator_main.run(
        namespaces=args.namespace, standalone=args.standalone, leader_elect=args.leader_elect
    )


# What-if's flags: each a finite number in its range (NaN, inf and the absurd refused,
# so that no figure comes out inf or nan): flag -> (least, most, least allowed).
WHATIF_BOUNDS: dict[str, tuple[float, float, bool]] = {
    "--recompute-us-per-token": (0.0, 1e9, False),  # up to 1,000 s a token
    "--bytes-per-token": (0.0, 1e12, False),
    "--bandwidth-gbps": (1e-9, 1e9, True),  # a byte a second up
    "--pull-fixed-ms": (0.0, 1e9, True),
    "--retention": (0.0, 1e9, False),  # seconds (~30 years)
    "--also": (0.0, 1e9, False),
}
STATUS_MAX_BYTES = 16 * 2**20


def _bounded(flag: str, value: Any, given: bool = True) -> float:
    """``value`` if a finite number within ``flag``'s bounds, else a ValueError naming
    the flag (``given``: from it, else from ``--status``)."""
    lo, hi, closed = WHATIF_BOUNDS[flag]
    ok = (
        isinstance(value, (int, float))
        and not isinstance(value, bool)
        and (lo <= value if closed else lo < value)
        and value <= hi
    )
    if not ok:
        low = f">= {lo:g}" if closed else f"> {lo:g}"
        source = "" if given else " (the --status file's figure)"
        raise ValueError(f"{flag}: {value!r}{source} is not a number {low} and <= {hi:g}")
    return float(value)


def _read_status(path: str) -> Any:
    import json

    def constant(name: str) -> Any:
        raise ValueError(f"{name} is not a JSON number")

    try:
        with open(path, "rb") as f:
            raw = f.read(STATUS_MAX_BYTES + 1)
        if len(raw) > STATUS_MAX_BYTES:
            raise ValueError(f"larger than {STATUS_MAX_BYTES:,} bytes")
        obj = json.loads(raw.decode("utf-8"), parse_constant=constant)
    except (OSError, ValueError) as exc:  # UnicodeDecodeError, big ints' digits too
        raise ValueError(f"--status {path}: {exc}") from None
    except RecursionError:
        raise ValueError(f"--status {path}: not a KVCacheStatus (JSON nested too deep)") from None
    if not isinstance(obj, dict):
        raise ValueError(f"--status {path}: not a KVCacheStatus (a JSON object)")
    return obj


def whatif_costs(args: argparse.Namespace) -> tuple[Any, float]:
    """The costs and retention for ``what-if``: a KVCacheStatus's measured figures
    (``--status``), each overridden by its flag. Raises ValueError naming the flag."""
    from . import whatif

    for flag in WHATIF_BOUNDS:
        value = getattr(args, flag[2:].replace("-", "_"))
        for v in value if isinstance(value, list) else [value]:
            if v is not None:
                _bounded(flag, v)
    measured: dict[str, Any] = {}
    retention: float | None = None
    if args.status:
        obj = _read_status(args.status)

        def section(obj: Any, key: str) -> dict[str, Any]:
            value = obj.get(key) if isinstance(obj, dict) else None
            return value if isinstance(value, dict) else {}

        def number(obj: dict[str, Any], key: str) -> float | None:
            value = obj.get(key)
            ok = isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0
            if ok and value > 1e100:  # a float would be inf, or the figures would
                raise ValueError(f"--status {args.status}: {key} above 1e100 is past any server")
            return float(value) if ok else None

        status = section(obj, "status")
        transfer = section(status, "transfer")
        fitted = section(status, "costs")
        gbps = number(transfer, "gigabytesPerSecond")
        bpt = number(transfer, "bytesPerToken")
        per_pulled = number(fitted, "pullSecondsPerToken")
        fixed = fitted.get("pullFixedSeconds")
        fixed_ok = isinstance(fixed, (int, float)) and not isinstance(fixed, bool)
        measured = {
            "bytes_per_token": bpt,
            # The costs the tuner fits from the pods' prefill legs (status.costs): a
            # pulled token's seconds as a bandwidth, a pull's fixed cost (0 when the fit
            # puts it below). Without them, NIXL's own GB/s.
            "bandwidth": bpt / per_pulled if bpt and per_pulled else (gbps * 1e9 if gbps else None),
            "pull_fixed": max(0.0, float(fixed)) if fixed_ok and -1e100 < fixed < 1e100 else None,
            "recompute": number(fitted, "recomputeSecondsPerToken"),
        }
        retention = number(section(status, "retention"), "appliedSeconds")
    bytes_per_token = args.bytes_per_token or measured.get("bytes_per_token")
    bandwidth = args.bandwidth_gbps * 1e9 if args.bandwidth_gbps else measured.get("bandwidth")
    pull_fixed = (
        args.pull_fixed_ms / 1e3 if args.pull_fixed_ms is not None else measured.get("pull_fixed")
    )
    where = " (the --status file has none yet)" if args.status else ""
    if not bytes_per_token or bytes_per_token <= 0:
        raise ValueError(f"--bytes-per-token: the KV bytes per token are needed{where}")
    if not bandwidth or bandwidth <= 0:
        raise ValueError(f"--bandwidth-gbps: the P<->D bandwidth is needed{where}")
    recompute = (
        args.recompute_us_per_token / 1e6
        if args.recompute_us_per_token is not None
        else measured.get("recompute")
    )
    if recompute is None or recompute <= 0:
        raise ValueError(
            f"--recompute-us-per-token: the prefill cost per token is needed (> 0){where}"
        )
    # What --status gave, in the flags' bounds too (its flag named).
    _bounded("--bytes-per-token", bytes_per_token, bool(args.bytes_per_token))
    _bounded("--bandwidth-gbps", bandwidth / 1e9, bool(args.bandwidth_gbps))
    _bounded("--recompute-us-per-token", recompute * 1e6, args.recompute_us_per_token is not None)
    _bounded("--pull-fixed-ms", (pull_fixed or 0.0) * 1e3, args.pull_fixed_ms is not None)
    costs = whatif.Costs(
        recompute_seconds_per_token=float(recompute),
        bytes_per_token=float(bytes_per_token),
        transfer_bytes_per_second=float(bandwidth),
        pull_fixed_seconds=float(pull_fixed or 0.0),
    )
    chosen = args.retention if args.retention is not None else retention
    chosen = chosen if chosen else whatif.VLLM_TTL_SECONDS
    return costs, _bounded("--retention", chosen, args.retention is not None or not retention)


def whatif_capacity(args: argparse.Namespace, costs: Any) -> Any:
    """D's KV for ``what-if``: ``--capacity-blocks`` or ``--capacity-gb`` (at the costs'
    bytes per token), of ``--kv-block-tokens``; None: no limit."""
    import math

    from . import whatif

    block = args.kv_block_tokens
    if block is None or not 1 <= block <= 4096:
        raise ValueError(f"--kv-block-tokens: {block} is not 1 to 4096")
    if args.capacity_blocks is not None and args.capacity_gb is not None:
        raise ValueError("--capacity-blocks and --capacity-gb: give one")
    if args.capacity_blocks is not None:
        if not 1 <= args.capacity_blocks <= 10**9:
            raise ValueError(f"--capacity-blocks: {args.capacity_blocks} is not 1 to 10^9")
        return whatif.Capacity(args.capacity_blocks, block)
    if args.capacity_gb is not None:
        gb = args.capacity_gb
        if not math.isfinite(gb) or not 0 < gb <= 1e6:
            raise ValueError(f"--capacity-gb: {gb} is not a size in GB (0 to 1e6)")
        blocks = gb * 1e9 / (block * costs.bytes_per_token)
        if not blocks >= 1:
            raise ValueError(f"--capacity-gb: {gb} GB holds no {block}-token block")
        return whatif.Capacity(math.floor(min(blocks, 1e9)), block)
    return None


def _cmd_whatif(args: argparse.Namespace) -> int:
    import json
    from pathlib import Path

    from . import traces, whatif

    try:
        costs, retention = whatif_costs(args)
        if args.block_tokens is not None and not 1 <= args.block_tokens <= traces.MAX_TOKENS:
            raise ValueError(
                f"--block-tokens: {args.block_tokens} is not 1 to {traces.MAX_TOKENS:,}"
            )
        capacity = whatif_capacity(args, costs)
        turns = traces.read_trace(Path(args.trace), args.format, args.block_tokens)
    except (ValueError, OSError) as exc:  # TraceError is a ValueError naming line and field
        print(f"kvferry-operator what-if: {exc}", file=sys.stderr)
        return 2
    if not turns:
        print(f"kvferry-operator what-if: {args.trace}: no turns", file=sys.stderr)
        return 2
    report = whatif.analyse(turns, costs, retention, args.also or (), capacity)
    if args.json:
        json.dump(report.as_dict(), sys.stdout, indent=2, allow_nan=False)
        sys.stdout.write("\n")
    else:
        sys.stdout.write(whatif.render_text(report))
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="kvferry-operator", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="print the Kubernetes objects for a DisaggregatedServer")
    p.add_argument("file", help="manifest with one or more DisaggregatedServers ('-' = stdin)")
    p.set_defaults(func=_cmd_render)
    p = sub.add_parser("run", help="run the operator against the cluster in KUBECONFIG")
    p.add_argument(
        "-n",
        "--namespace",
        action="append",
        default=[],
        help="watch only this namespace (repeatable); default all",
    )
    p.add_argument(
        "--standalone",
        action="store_true",
        help="no kopf peering (the chart always passes it: --leader-elect elects instead)",
    )
    p.add_argument(
        "--leader-elect",
        action="store_true",
        help="run handlers only while holding the Lease KVFERRY_LEADER_ELECTION_ID in "
        "KVFERRY_LEADER_ELECTION_NAMESPACE; wait as a standby otherwise",
    )
    p.set_defaults(func=_cmd_run)
    p = sub.add_parser(
        "what-if",
        help="what bidirectional reuse would do for a trace of your sessions (docs/what-if.md)",
    )
    p.add_argument("--trace", required=True, help="JSON lines, one turn each (docs/what-if.md)")
    p.add_argument(
        "--format",
        choices=("auto", "kvferry", "mooncake", "bailian"),
        default="auto",
        help="the trace's format: kvferry's own, Mooncake/aiperf, Qwen-Bailian (default: "
        "detected from its first line)",
    )
    p.add_argument(
        "--block-tokens",
        type=int,
        help="tokens per hash id in a mooncake or bailian trace (default 512 and 16)",
    )
    p.add_argument(
        "--status",
        help="a KVCacheStatus as `kubectl get kv-cache-status NAME -o json` prints it: its "
        "fitted costs (recompute, pull), bytes per token and retention",
    )
    p.add_argument("--recompute-us-per-token", type=float, help="prefill cost per token (us)")
    p.add_argument("--bytes-per-token", type=float, help="KV bytes per token (all layers)")
    p.add_argument("--bandwidth-gbps", type=float, help="P<->D bandwidth (GB/s)")
    p.add_argument("--pull-fixed-ms", type=float, help="a pull's fixed latency (ms; default 0)")
    p.add_argument(
        "--retention",
        type=float,
        help="seconds D holds a handle (default: --status's applied retention, else 480)",
    )
    p.add_argument(
        "--also", type=float, action="append", help="another retention for the table (repeatable)"
    )
    p.add_argument(
        "--capacity-gb",
        type=float,
        help="D's KV cache (GB of 10^9 bytes; vLLM logs GiB): replay the trace at that size "
        "as the decode sidecar keeps handles (default: no limit)",
    )
    p.add_argument(
        "--capacity-blocks", type=int, help="D's KV cache in blocks (vLLM's num_gpu_blocks)"
    )
    p.add_argument(
        "--kv-block-tokens", type=int, default=16, help="D's KV block size in tokens (default 16)"
    )
    p.add_argument("--json", action="store_true", help="every figure as JSON")
    p.set_defaults(func=_cmd_whatif)
    args = parser.parse_args(argv)
    if args.command == "what-if":  # plain Python: no extra needed
        return int(args.func(args))
    # Both commands need the operator extra (render validates with its CEL and
    # JSON-schema libraries); say so instead of dying on an import.
    absent = extras.missing(extras.OPERATOR)
    if absent:
        print(f"{parser.prog}: {extras.message(extras.OPERATOR, absent)}", file=sys.stderr)
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
