"""A real Prometheus server for local runs, and the dashboard's queries checked on it.

``start_prometheus`` runs the Debian ``prometheus`` binary (hack/prometheus.sh
installs it) with static targets labelled as the chart's PodMonitor would label
them in a cluster: each target carries the ``__meta_kubernetes_pod_label_*``
labels a pod of that server has, and the PodMonitor's own relabelings turn them
into ``server`` and ``role``. ``check_queries`` evaluates PromQL over a time range
through the HTTP API and names each query that does not parse or returns no
sample.
"""

from __future__ import annotations

import json
import re
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .engines import repo_root
from .procs import LIVE, EngineError, free_port, stop_group, tail

SCRAPE_SECONDS = 2


def prometheus_binary() -> str:
    """hack/prometheus.sh: the binary's path, installing Debian's package if needed."""
    res = subprocess.run(
        ["bash", str(repo_root() / "hack" / "prometheus.sh")],
        capture_output=True,
        text=True,
        timeout=600,
    )
    if res.returncode != 0:
        raise EngineError(f"hack/prometheus.sh failed:\n{tail(res.stderr, 30)}")
    return res.stdout.strip().splitlines()[-1]


@dataclass(frozen=True)
class Target:
    address: str  # host:port
    labels: Mapping[str, str]


def pod_target(
    address: str, *, namespace: str, pod: str, container: str, pod_labels: Mapping[str, str]
) -> Target:
    """A target as Kubernetes service discovery presents a pod's port: the namespace,
    pod and container labels the Prometheus Operator sets, plus the pod's labels as
    ``__meta_kubernetes_pod_label_<sanitized>`` for the monitor's relabelings."""
    meta = {
        "__meta_kubernetes_pod_label_" + re.sub(r"[^a-zA-Z0-9_]", "_", k): v
        for k, v in pod_labels.items()
    }
    return Target(address, {"namespace": namespace, "pod": pod, "container": container, **meta})


def relabel_configs(monitor_relabelings: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """A Prometheus Operator relabeling list (camelCase) as Prometheus config."""
    keys = {"sourceLabels": "source_labels", "targetLabel": "target_label"}
    return [{keys.get(k, k): v for k, v in r.items()} for r in monitor_relabelings]


@dataclass(eq=False)
class Prometheus:
    binary: str
    folder: Path
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.folder / "prometheus.log"

    def write_config(
        self,
        pods: Sequence[Target],
        relabelings: Sequence[Mapping[str, Any]],
        honor_labels_targets: Sequence[str] = (),
    ) -> Path:
        jobs: list[dict[str, Any]] = [
            {
                "job_name": "kvferry-pods",
                "static_configs": [
                    {"targets": [t.address], "labels": dict(t.labels)} for t in pods
                ],
                "relabel_configs": relabel_configs(relabelings),
            }
        ]
        if honor_labels_targets:
            jobs.append(
                {
                    "job_name": "kvferry-operator",
                    "honor_labels": True,
                    "static_configs": [{"targets": list(honor_labels_targets)}],
                }
            )
        config = {
            "global": {
                "scrape_interval": f"{SCRAPE_SECONDS}s",
                "evaluation_interval": f"{SCRAPE_SECONDS}s",
            },
            "scrape_configs": jobs,
        }
        path = self.folder / "prometheus.yml"
        path.write_text(yaml.safe_dump(config, sort_keys=False))
        return path

    def start(self, config: Path, timeout: float = 60.0) -> Prometheus:
        self.folder.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [
                    self.binary,
                    f"--config.file={config}",
                    f"--storage.tsdb.path={self.folder / 'data'}",
                    f"--web.listen-address=127.0.0.1:{self.port}",
                    "--storage.tsdb.retention.time=1d",
                ],
                cwd=str(self.folder),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        LIVE.add(self)
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise EngineError(f"prometheus exited:\n{self.logtail()}")
            try:
                with urllib.request.urlopen(self.url + "/-/ready", timeout=2) as r:
                    if r.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise EngineError(f"prometheus not ready after {timeout:.0f} s:\n{self.logtail()}")
            time.sleep(0.3)

    def stop(self) -> None:
        LIVE.discard(self)
        proc, self.proc = self.proc, None
        if proc is not None:
            stop_group(proc, 10.0)

    def logtail(self, lines: int = 40) -> str:
        try:
            return tail(self.log_path.read_text(errors="replace"), lines)
        except OSError as e:
            return f"(no log: {e})"

    # ------------------------------------------------------------------ HTTP API

    def api(self, path: str, params: Mapping[str, Any]) -> tuple[int, dict[str, Any]]:
        query = urllib.parse.urlencode(params, doseq=True)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as exc:
            return exc.code, json.loads(exc.read() or b"{}")

    def query_range(
        self, expr: str, start: float, end: float, step: float = 5.0
    ) -> tuple[int, dict[str, Any]]:
        return self.api("query_range", {"query": expr, "start": start, "end": end, "step": step})

    def label_values(self, label: str, match: str) -> list[str]:
        _, body = self.api(f"label/{label}/values", {"match[]": match})
        return list(body.get("data") or [])

    def wait_for_targets_up(self, count: int, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        up: list[Any] = []
        while time.monotonic() < deadline:
            _, body = self.api("query", {"query": "up == 1"})
            up = (body.get("data") or {}).get("result") or []
            if len(up) >= count:
                return
            time.sleep(1.0)
        raise EngineError(f"{len(up)} of {count} scrape targets up after {timeout:.0f} s")


# ---------------------------------------------------------------------- the dashboard check

# Grafana's built-in variables, as the check substitutes them: "All" of a variable is
# ".*" (the dashboard's allValue); the rate window covers several scrapes.
DEFAULT_SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "10s",
    "$__range": "1h",
    "$namespace": ".*",
    "$server": ".*",
    "$pod": ".*",
}


def substitute(expr: str, values: Mapping[str, str]) -> str:
    for key in sorted(values, key=len, reverse=True):  # $__range before $__r...
        expr = expr.replace(key, values[key])
    return expr


def has_sample(result: list[dict[str, Any]]) -> bool:
    """Any series with a sample that is a number (NaN: 0/0 or a histogram without
    observations, which is no data)."""
    return any(
        any(v[1] not in ("NaN", "+Inf", "-Inf") for v in series.get("values", []))
        for series in result
    )


def check_queries(
    prom: Prometheus,
    queries: Sequence[tuple[str, str]],
    start: float,
    end: float,
    substitutions: Mapping[str, str] = DEFAULT_SUBSTITUTIONS,
) -> list[str]:
    """One line per (title, expr) that does not parse or has no sample in [start, end]."""
    problems = []
    for title, expr in queries:
        promql = substitute(expr, substitutions)
        status, body = prom.query_range(promql, start, end)
        if status != 200 or body.get("status") != "success":
            problems.append(f"{title}: {body.get('errorType')}: {body.get('error')} in {promql}")
        elif not has_sample(body["data"]["result"]):
            problems.append(f"{title}: no data from the run for {promql}")
    return problems


def check_variables(prom: Prometheus, variables: Sequence[tuple[str, str, str]]) -> list[str]:
    """Each ``label_values(selector, label)`` variable must list at least one value."""
    problems = []
    for name, _, query in variables:
        match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", query)
        if not match:
            problems.append(f"${name}: not a label_values() query: {query}")
            continue
        selector = substitute(match.group(1), DEFAULT_SUBSTITUTIONS)
        if not prom.label_values(match.group(2), selector):
            problems.append(f"${name}: no values for {query}")
    return problems
