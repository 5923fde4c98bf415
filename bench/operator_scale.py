"""Operator scale: N DisaggregatedServers on a real control plane with kwok nodes.

``python -m bench.operator_scale`` (``make bench-operator``). For each N (default 100
and 300), on a fresh control plane (hack/controlplane.sh: etcd, kube-apiserver,
controller-manager, scheduler, kwok GPU nodes, enough for every pod) and a fresh
operator process (the real one, `kvferry-operator run --standalone`, with the chart's
default settings), it applies N servers at once and measures:

- the time from the first apply until every server's ``Ready`` condition is True
  (kwok marks the pods Ready; the operator must render, apply, watch and fold status);
- the operator's CPU seconds and peak RSS (from /proc) over that phase;
- the API requests the operator made, per server, from the API server's own audit
  log (the operator runs under its own client certificate, the only user the audit
  policy records), by verb and resource;
- of those, the Events it posted and the status patches of the servers, per server,
  and the Events by reason (read back from the API server before it goes);
- then an idle window (default 60 s): CPU and requests per server per minute when
  nothing changes. Report authentication (TokenReviews, and the pod and StatefulSet
  reads the report endpoint makes) is counted apart: it follows the reports, not the
  servers (no sidecar reports here, so it is 0 unless one does).

Targets (issue 13) at N=100: all Ready within 60 s, peak RSS at most 200 MB; (issue
23) at most 3 Events and 3 status patches per server and 20 requests in all to
Ready, at most 0.2 requests per server per minute idle.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvferry_dev.audit import AuditedRequest as Request
from kvferry_dev.audit import read_audit

from .common import (
    DEFAULT_OUT,
    ROOT,
    Result,
    Target,
    process_cpu_seconds,
    process_peak_rss_mb,
    pyplot,
    say,
    table,
)

OPERATOR_USER = "kvferry-operator"
NAMESPACE = "bench"
# Fake nodes this benchmark adds (hack/controlplane.sh's own 2 hold 8 GPUs each): few
# and large, so the control plane starts quickly on 2 cores; the operator never
# looks at nodes, the scheduler does.
GPUS_PER_NODE = 100
PODS_PER_NODE = 110

AUDIT_POLICY = f"""apiVersion: audit.k8s.io/v1
kind: Policy
omitStages: [RequestReceived]
rules:
- level: Metadata
  users: [{OPERATOR_USER}]
- level: None
"""


def server_manifest(i: int) -> dict[str, Any]:
    """The README's minimal server (one P and one D pod, one GPU each)."""
    return {
        "apiVersion": "kvferry.io/v1alpha1",
        "kind": "DisaggregatedServer",
        "metadata": {"name": f"s{i:04d}", "namespace": NAMESPACE},
        "spec": {
            "model": {
                "name": "Qwen/Qwen3-8B",
                "source": {"pvc": {"claimName": "models", "path": "qwen3-8b"}},
            }
        },
    }


def nodes_for(n: int) -> int:
    """Fake nodes to hold 2 one-GPU pods per server, with room to spare."""
    pods = 2 * n
    return max(math.ceil(pods / GPUS_PER_NODE), math.ceil(pods / PODS_PER_NODE)) + 1


def node_manifest(i: int) -> dict[str, Any]:
    # CPUs and memory for PODS_PER_NODE pods at the engine's GPU defaults (4 CPUs, 24Gi).
    cap = {"cpu": "1024", "memory": "4Ti", "pods": str(PODS_PER_NODE)}
    cap["nvidia.com/gpu"] = str(GPUS_PER_NODE)
    return {
        "apiVersion": "v1",
        "kind": "Node",
        "metadata": {
            "name": f"bench-node-{i}",
            "annotations": {"kwok.x-k8s.io/node": "fake"},
            "labels": {
                "kubernetes.io/hostname": f"bench-node-{i}",
                "kubernetes.io/os": "linux",
                "kubernetes.io/arch": "amd64",
                "type": "kwok",
            },
        },
        "status": {"capacity": cap, "allocatable": cap},
    }


# ----------------------------------------------------------------------------- cluster


@dataclass
class Cluster:
    dir: Path
    port: int
    nodes: int
    audit_log: Path = field(init=False)

    def __post_init__(self) -> None:
        self.audit_log = self.dir / "audit.log"

    @property
    def state(self) -> Path:
        return self.dir / "cp"

    @property
    def admin_kubeconfig(self) -> Path:
        return self.state / "kubeconfig"

    def env(self) -> dict[str, str]:
        policy = self.dir / "audit-policy.yaml"
        policy.write_text(AUDIT_POLICY)
        return {
            **os.environ,
            "KVFERRY_CP_DIR": str(self.state),
            "KVFERRY_CP_PORT": str(self.port),
            "KVFERRY_CP_NODES": "2",
            "KVFERRY_CP_APISERVER_ARGS": (
                f"--audit-policy-file={policy} --audit-log-path={self.audit_log} "
                "--audit-log-format=json --audit-log-maxsize=0"
            ),
        }

    def up(self) -> None:
        self.dir.mkdir(parents=True, exist_ok=True)
        res = subprocess.run(
            ["bash", str(ROOT / "hack" / "controlplane.sh"), "up"],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=1800,
        )
        if res.returncode != 0:
            said = [ln for ln in res.stderr.splitlines() if ln.startswith("controlplane:")]
            raise SystemExit("control plane did not start:\n" + "\n".join(said[-20:]))
        nodes = [node_manifest(i) for i in range(self.nodes)]
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"apiVersion": "v1", "kind": "List", "items": nodes}),
        )
        self.kubectl(
            "wait", "--for", "condition=Ready", "node", "--all", "--timeout", "120s", timeout=150
        )

    def down(self) -> None:
        subprocess.run(
            ["bash", str(ROOT / "hack" / "controlplane.sh"), "down"],
            env=self.env(),
            capture_output=True,
            timeout=120,
        )

    def component_cpu(self) -> dict[str, float]:
        """CPU seconds so far of each control-plane process (hack/controlplane.sh's pids)."""
        out = {}
        for line in (self.state / "pids").read_text().splitlines():
            name, pid = line.split()
            with contextlib.suppress(OSError, ValueError, IndexError):
                out[name] = process_cpu_seconds(int(pid))
        return out

    def kubectl(self, *args: str, input: str | None = None, timeout: float = 120) -> str:
        res = subprocess.run(
            ["kubectl", "--kubeconfig", str(self.admin_kubeconfig), *args],
            input=input,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if res.returncode != 0:
            raise SystemExit(f"kubectl {' '.join(args[:3])} failed: {res.stderr[-2000:]}")
        return res.stdout

    def operator_kubeconfig(self) -> Path:
        """A client certificate of its own for the operator (system:masters, like the
        admin's), so the audit policy can record the operator and nobody else."""
        pki = self.state / "pki"
        key, csr, crt = (self.dir / f"operator.{x}" for x in ("key", "csr", "crt"))
        ext = self.dir / "client.ext"
        ext.write_text("extendedKeyUsage=clientAuth\n")
        for cmd in (
            [
                "openssl",
                "req",
                "-newkey",
                "rsa:2048",
                "-nodes",
                "-keyout",
                str(key),
                "-out",
                str(csr),
                "-subj",
                f"/O=system:masters/CN={OPERATOR_USER}",
            ],
            [
                "openssl",
                "x509",
                "-req",
                "-in",
                str(csr),
                "-CA",
                str(pki / "ca.crt"),
                "-CAkey",
                str(pki / "ca.key"),
                "-CAcreateserial",
                "-out",
                str(crt),
                "-days",
                "2",
                "-extfile",
                str(ext),
            ],
        ):
            subprocess.run(cmd, check=True, capture_output=True)
        text = self.admin_kubeconfig.read_text()
        text = text.replace(str(pki / "admin.crt"), str(crt)).replace(
            str(pki / "admin.key"), str(key)
        )
        path = self.dir / "operator.kubeconfig"
        path.write_text(text)
        return path

    def prepare_namespace(self) -> None:
        """The namespace and a bound `models` PVC (kwok has no volume provisioner)."""
        objs = [
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}},
            {
                "apiVersion": "v1",
                "kind": "PersistentVolume",
                "metadata": {"name": "models-bench"},
                "spec": {
                    "capacity": {"storage": "1Gi"},
                    "accessModes": ["ReadOnlyMany"],
                    "hostPath": {"path": "/tmp/kvferry-models"},
                    "claimRef": {"namespace": NAMESPACE, "name": "models"},
                },
            },
            {
                "apiVersion": "v1",
                "kind": "PersistentVolumeClaim",
                "metadata": {"name": "models", "namespace": NAMESPACE},
                "spec": {
                    "accessModes": ["ReadOnlyMany"],
                    "resources": {"requests": {"storage": "1Gi"}},
                    "volumeName": "models-bench",
                    "storageClassName": "",
                },
            },
        ]
        self.kubectl(
            "apply",
            "-f",
            "-",
            input=json.dumps({"kind": "List", "apiVersion": "v1", "items": objs}),
        )

    def ready_count(self) -> tuple[int, int]:
        """(servers Ready=True, servers seen)."""
        items = json.loads(
            self.kubectl("get", "dserver", "-n", NAMESPACE, "-o", "json", timeout=60)
        )["items"]
        ready = 0
        for it in items:
            for c in (it.get("status") or {}).get("conditions") or []:
                if c.get("type") == "Ready" and c.get("status") == "True":
                    ready += 1
        return ready, len(items)


# ----------------------------------------------------------------------------- operator


@dataclass
class OperatorProcess:
    kubeconfig: Path
    log_path: Path
    proc: subprocess.Popen[bytes] | None = None
    resync_seconds: float | None = None  # None: the operator's default

    def start(self) -> None:
        env = {k: v for k, v in os.environ.items() if not k.startswith(("KVFERRY_", "KUBECONFIG"))}
        # The chart's defaults otherwise (resync, publish 10 s); no report endpoint
        # (no TLS certificate) and no /metrics port: no sidecars report here.
        env.update({"KUBECONFIG": str(self.kubeconfig), "KVFERRY_METRICS_PORT": "0"})
        if self.resync_seconds is not None:
            env["KVFERRY_RESYNC_SECONDS"] = str(self.resync_seconds)
        log = open(self.log_path, "ab")  # noqa: SIM115 - the process owns it
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvferry_operator.cli", "run", "--standalone"],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            cwd="/",
            start_new_session=True,
        )

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(timeout=10)
        self.proc = None


# ----------------------------------------------------------------------------- audit


def between(reqs: list[Request], t0: float, t1: float) -> list[Request]:
    return [r for r in reqs if t0 <= r.at < t1]


# What the report endpoint asks to authenticate a push (report_endpoint.py): counted
# apart from reconciling, since it grows with the reporting pods, not the servers.
REPORT_AUTH = {"create tokenreviews", "get pods", "get statefulsets"}


def is_report_auth(r: Request) -> bool:
    return f"{r.verb} {r.resource}" in REPORT_AUTH


# ----------------------------------------------------------------------------- one run


@dataclass
class Run:
    n: int
    ready_seconds: float | None
    ready_timeline: list[tuple[float, int]]
    cpu_seconds: float
    peak_rss_mb: float
    requests: int
    requests_by: dict[str, int]
    idle_seconds: float
    idle_cpu_seconds: float
    idle_requests: int
    idle_requests_by: dict[str, int]
    startup_rss_mb: float
    apply_seconds: float
    control_plane_cpu: dict[str, float]  # CPU seconds to Ready, per component
    events_by_reason: dict[str, int] = field(default_factory=dict)
    idle_report_auth: int = 0

    @property
    def requests_per_server(self) -> float:
        return self.requests / self.n

    @property
    def events_per_server(self) -> float:
        return self.requests_by.get("create events", 0) / self.n

    @property
    def status_patches_per_server(self) -> float:
        return self.requests_by.get("patch disaggregatedservers/status", 0) / self.n

    @property
    def idle_requests_per_server_minute(self) -> float:
        return self.idle_requests / self.n / (self.idle_seconds / 60) if self.idle_seconds else 0


def wait_for_watches(cluster: Cluster, op: OperatorProcess, timeout: float = 120) -> float:
    """Until the operator watches DisaggregatedServers (read from the audit log)."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if not op.alive():
            raise SystemExit(f"the operator exited; log {op.log_path}")
        if any(
            r.verb == "watch" and r.resource == "disaggregatedservers"
            for r in read_audit(cluster.audit_log, OPERATOR_USER)
        ):
            return time.monotonic() - t0
        time.sleep(0.5)
    raise SystemExit(
        f"the operator did not watch servers within {timeout:.0f} s; log {op.log_path}"
    )


def run_one(
    n: int, work: Path, port: int, idle: float, ready_timeout: float, resync: float | None = None
) -> Run:
    cluster = Cluster(work / f"n{n}", port, nodes_for(n))
    shutil.rmtree(cluster.dir, ignore_errors=True)
    say(
        f"N={n}: control plane + {cluster.nodes} kwok nodes of {GPUS_PER_NODE} GPUs "
        f"(port {port}) ..."
    )
    cluster.up()
    op = OperatorProcess(
        cluster.operator_kubeconfig(), cluster.dir / "operator.log", resync_seconds=resync
    )
    try:
        cluster.prepare_namespace()
        op.start()
        took = wait_for_watches(cluster, op)
        time.sleep(2.0)  # the other watches settle (children, pods)
        startup_rss = process_peak_rss_mb(op.pid)
        say(f"N={n}: operator watching after {took:.1f} s (RSS {startup_rss:.0f} MB); applying")
        manifest = {
            "apiVersion": "v1",
            "kind": "List",
            "items": [server_manifest(i) for i in range(n)],
        }
        cpu0 = process_cpu_seconds(op.pid)
        cp0 = cluster.component_cpu()
        wall0 = time.time()
        t0 = time.monotonic()
        # Applied as a GitOps tool would, one object after another; readiness is polled
        # meanwhile (the first servers turn Ready before the last is applied).
        applying = threading.Thread(
            target=cluster.kubectl,
            args=("apply", "--server-side", "-f", "-"),
            kwargs={"input": json.dumps(manifest), "timeout": 900},
            daemon=True,
        )
        applying.start()
        applied = 0.0
        timeline: list[tuple[float, int]] = [(0.0, 0)]
        ready_at: float | None = None
        while time.monotonic() - t0 < ready_timeout:
            if not applied and not applying.is_alive():
                applied = time.monotonic() - t0
            if not op.alive():
                raise SystemExit(f"the operator exited; log {op.log_path}")
            ready, _seen = cluster.ready_count()
            now = time.monotonic() - t0
            timeline.append((round(now, 2), ready))
            if ready == n:
                ready_at = now
                break
            time.sleep(1.0)
        applying.join(timeout=900)
        applied = applied or time.monotonic() - t0
        cpu1 = process_cpu_seconds(op.pid)
        cp1 = cluster.component_cpu()
        wall1 = time.time()
        rss = process_peak_rss_mb(op.pid)
        if ready_at is None:
            say(f"N={n}: NOT all Ready after {ready_timeout:.0f} s ({timeline[-1][1]}/{n})")
        else:
            say(f"N={n}: all Ready after {ready_at:.1f} s (apply took {applied:.1f} s)")
        say(f"N={n}: idle window {idle:.0f} s ...")
        time.sleep(idle)
        cpu2 = process_cpu_seconds(op.pid)
        wall2 = time.time()
        rss = max(rss, process_peak_rss_mb(op.pid))
        reqs = read_audit(cluster.audit_log, OPERATOR_USER)
        busy = between(reqs, wall0, wall1)
        quiet_all = between(reqs, wall1, wall2)
        quiet = [r for r in quiet_all if not is_report_auth(r)]
        events = Counter()
        for ev in json.loads(cluster.kubectl("get", "events", "-n", NAMESPACE, "-o", "json"))[
            "items"
        ]:
            # Only the operator posts Events about servers (kopf's and its own).
            if (ev.get("involvedObject") or {}).get("kind") == "DisaggregatedServer":
                events[ev.get("reason", "?")] += int(ev.get("count") or 1)

        def by(rs: list[Request]) -> dict[str, int]:
            return dict(Counter(f"{r.verb} {r.resource}" for r in rs).most_common())

        return Run(
            n=n,
            ready_seconds=ready_at,
            ready_timeline=timeline,
            cpu_seconds=cpu1 - cpu0,
            peak_rss_mb=rss,
            requests=len(busy),
            requests_by=by(busy),
            idle_seconds=wall2 - wall1,
            idle_cpu_seconds=cpu2 - cpu1,
            idle_requests=len(quiet),
            idle_requests_by=by(quiet),
            startup_rss_mb=startup_rss,
            apply_seconds=applied,
            control_plane_cpu={k: round(cp1[k] - cp0.get(k, 0.0), 1) for k in cp1},
            events_by_reason=dict(events.most_common()),
            idle_report_auth=len(quiet_all) - len(quiet),
        )
    finally:
        op.stop()
        cluster.down()


# ----------------------------------------------------------------------------- report


def plot(runs: list[Run], path: Path) -> None:
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r, color in zip(runs, ("#1f77b4", "#ff7f0e", "#2ca02c"), strict=False):
        ax1.axvspan(0, r.apply_seconds, color=color, alpha=0.08)
        ax1.text(
            r.apply_seconds, 2 + 6 * runs.index(r), f" apply of {r.n} ends", color=color, fontsize=7
        )
        xs = [t for t, _ in r.ready_timeline]
        ys = [100 * c / r.n for _, c in r.ready_timeline]
        label = f"N={r.n}: " + (
            f"all Ready at {r.ready_seconds:.0f} s" if r.ready_seconds else "not all Ready"
        )
        ax1.plot(xs, ys, drawstyle="steps-post", label=label, color=color)
    ax1.axvline(60, color="grey", ls="--", lw=1)
    ax1.text(61, 5, "target at N=100: 60 s", color="grey", fontsize=8)
    ax1.set_xlabel("seconds since the first apply (shaded: kubectl apply still running)")
    ax1.set_ylabel("servers Ready (%)")
    ax1.set_title("Time until every DisaggregatedServer is Ready")
    ax1.legend(loc="lower right", fontsize=8)
    names = [f"N={r.n}" for r in runs]
    x = range(len(runs))
    w = 0.38
    ax2.bar([i - w / 2 for i in x], [r.peak_rss_mb for r in runs], w, label="peak RSS (MB)")
    ax2.bar([i + w / 2 for i in x], [r.cpu_seconds for r in runs], w, label="CPU seconds to Ready")
    ax2.axhline(200, color="grey", ls="--", lw=1, label="RSS target at N=100: 200 MB")
    for i, r in enumerate(runs):
        ax2.text(
            i,
            max(r.peak_rss_mb, r.cpu_seconds) + 8,
            f"{r.requests_per_server:.1f} req/server",
            ha="center",
            fontsize=8,
        )
    ax2.set_xticks(list(x), names)
    ax2.set_title("Operator cost (one process)")
    ax2.set_ylim(0, 260)
    ax2.legend(fontsize=8, loc="upper left", ncol=2)
    fig.suptitle("kvferry operator on a kwok control plane (2 shared CPU cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def runs_from_json(path: Path) -> list[Run]:
    """The runs of a written result (to redraw its plot)."""
    out = []
    for r in json.loads(path.read_text())["results"]["runs"]:
        out.append(
            Run(
                n=r["servers"],
                ready_seconds=r["readySeconds"],
                ready_timeline=[tuple(x) for x in r["readyTimeline"]],
                cpu_seconds=r["cpuSeconds"],
                peak_rss_mb=r["peakRssMB"],
                requests=r["apiRequests"],
                requests_by=r["apiRequestsByVerbResource"],
                idle_seconds=r["idleSeconds"],
                idle_cpu_seconds=r["idleCpuSeconds"],
                idle_requests=0,
                idle_requests_by=r["idleApiRequestsByVerbResource"],
                startup_rss_mb=r["startupRssMB"],
                apply_seconds=r.get("applySeconds", 0.0),
                control_plane_cpu=r.get("controlPlaneCpuSeconds", {}),
            )
        )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m bench.operator_scale", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--servers", type=int, nargs="+", default=[100, 300])
    p.add_argument("--idle", type=float, default=60.0, help="idle window after Ready (s)")
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument(
        "--resync",
        type=float,
        help="the operator's KVFERRY_RESYNC_SECONDS (default: its own), e.g. to put a "
        "safety pass inside the idle window",
    )
    p.add_argument(
        "--port", type=int, default=int(os.environ.get("KVFERRY_BENCH_CP_PORT", "29443"))
    )
    p.add_argument("--work", type=Path, default=Path(f"/tmp/kvferry-bench-operator-{os.getpid()}"))
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--replot", type=Path, help="only redraw the plot of this result JSON")
    args = p.parse_args(argv)
    if args.replot:
        plot(runs_from_json(args.replot), args.replot.with_suffix(".png"))
        return 0
    if shutil.which("kubectl") is None:
        raise SystemExit("kubectl is not on PATH (the test extra installs it into .venv/bin)")
    result = Result("operator-scale")
    result.settings = {
        "servers": args.servers,
        "idleSeconds": args.idle,
        "readyTimeoutSeconds": args.ready_timeout,
        "operatorSettings": "chart defaults"
        + (f", KVFERRY_RESYNC_SECONDS={args.resync:g}" if args.resync else ""),
        "server": "examples/minimal.yaml shape: 1 P + 1 D pod, 1 GPU each, 8 children",
    }
    print(result.header())
    started = time.monotonic()
    runs: list[Run] = []
    with _interruptible():
        for n in args.servers:
            runs.append(
                run_one(n, args.work, args.port, args.idle, args.ready_timeout, args.resync)
            )
    result.seconds = round(time.monotonic() - started, 1)
    rows = [
        (
            r.n,
            r.ready_seconds,
            r.cpu_seconds,
            r.peak_rss_mb,
            r.requests,
            r.requests_per_server,
            r.events_per_server,
            r.status_patches_per_server,
            r.idle_cpu_seconds,
            r.idle_requests_per_server_minute,
        )
        for r in runs
    ]
    print()
    print(
        table(
            (
                "servers",
                "all Ready (s)",
                "CPU s",
                "peak RSS MB",
                "API requests",
                "req/server",
                "Events/server",
                "status patches/server",
                "idle CPU s",
                "idle req/server/min",
            ),
            rows,
        )
    )
    if len(runs) >= 2:
        a, b = runs[0], runs[-1]
        if a.ready_seconds and b.ready_seconds:
            print(
                f"\nN={b.n} vs N={a.n}: {b.n / a.n:.1f}x the servers took "
                f"{b.ready_seconds / a.ready_seconds:.2f}x the time, "
                f"{b.cpu_seconds / a.cpu_seconds:.2f}x the CPU, "
                f"{b.peak_rss_mb / a.peak_rss_mb:.2f}x the peak RSS"
            )
    for r in runs:
        top = ", ".join(f"{k} {v}" for k, v in list(r.requests_by.items())[:6])
        print(f"N={r.n} requests to Ready: {top}")
        reasons = ", ".join(f"{k} {v}" for k, v in r.events_by_reason.items())
        print(f"N={r.n} Events on servers by reason (to the end of the idle window): {reasons}")
        idle = ", ".join(f"{k} {v}" for k, v in r.idle_requests_by.items()) or "none"
        print(
            f"N={r.n} idle requests ({r.idle_seconds:.0f} s): {idle}; report authentication "
            f"apart: {r.idle_report_auth}"
        )
        cpu = ", ".join(
            f"{k} {v:.0f}" for k, v in sorted(r.control_plane_cpu.items(), key=lambda kv: -kv[1])
        )
        print(
            f"N={r.n} CPU seconds to Ready: operator {r.cpu_seconds:.0f}, {cpu}; "
            f"kubectl apply of the {r.n} servers alone took {r.apply_seconds:.0f} s"
        )
    result.results = {
        "runs": [
            {
                "servers": r.n,
                "readySeconds": r.ready_seconds,
                "cpuSeconds": round(r.cpu_seconds, 2),
                "peakRssMB": round(r.peak_rss_mb, 1),
                "startupRssMB": round(r.startup_rss_mb, 1),
                "applySeconds": round(r.apply_seconds, 1),
                "controlPlaneCpuSeconds": r.control_plane_cpu,
                "apiRequests": r.requests,
                "apiRequestsPerServer": round(r.requests_per_server, 2),
                "apiRequestsByVerbResource": r.requests_by,
                "eventsPerServer": round(r.events_per_server, 2),
                "statusPatchesPerServer": round(r.status_patches_per_server, 2),
                "eventsByReason": r.events_by_reason,
                "idleReportAuthRequests": r.idle_report_auth,
                "idleSeconds": round(r.idle_seconds, 1),
                "idleCpuSeconds": round(r.idle_cpu_seconds, 2),
                "idleApiRequestsPerServerPerMinute": round(r.idle_requests_per_server_minute, 2),
                "idleApiRequestsByVerbResource": r.idle_requests_by,
                "readyTimeline": r.ready_timeline,
            }
            for r in runs
        ]
    }
    # The targets are set at 100 servers; a run without N=100 is judged at its first N.
    at100 = next((r for r in runs if r.n == 100), runs[0] if runs else None)
    if at100:
        note = "" if at100.n == 100 else f"measured at {at100.n} servers, set for 100"
        result.targets = [
            Target("all servers Ready", at100.ready_seconds, "<=", 60, " s", note),
            Target("operator peak RSS", round(at100.peak_rss_mb, 1), "<=", 200, " MB", note),
            Target(
                "requests per server to Ready", round(at100.requests_per_server, 1), "<=", 20, ""
            ),
            Target("Events per server to Ready", round(at100.events_per_server, 2), "<=", 3, ""),
            Target(
                "status patches per server to Ready",
                round(at100.status_patches_per_server, 2),
                "<=",
                3,
                "",
            ),
            Target(
                "idle requests per server per minute",
                round(at100.idle_requests_per_server_minute, 3),
                "<=",
                0.2,
                "",
            ),
        ]
    result.print_targets()
    path = result.write(args.out)
    plot(runs, args.out / "operator-scale.png")
    say(f"wrote {path} and {args.out / 'operator-scale.png'} in {result.seconds:.0f} s")
    return 0


@contextlib.contextmanager
def _interruptible() -> Iterator[None]:
    """SIGTERM unwinds like Ctrl-C, so the `finally` blocks stop what was started."""

    def handler(signum: int, frame: Any) -> None:
        raise KeyboardInterrupt

    old = signal.signal(signal.SIGTERM, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)


if __name__ == "__main__":
    sys.exit(main())
