"""Plot the Grafana dashboard's panels from an engine-tier run, as a PNG for the README.

Grafana itself is not installable from the package registries this project uses, so
this draws the same panels (same queries, same titles) with matplotlib from the data
the engine tier's real Prometheus collected:

    KVFERRY_DASHBOARD_DUMP=/tmp/dashboard.json flock /tmp/kvferry-engine.lock \\
        .venv/bin/pytest tests/engine/test_kv_cache_status.py
    .venv/bin/pip install matplotlib==3.11.2     # not a test dependency
    .venv/bin/python hack/dashboard_png.py /tmp/dashboard.json docs/dashboard.png
"""

from __future__ import annotations

import json
import math
import re
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

# The panels shown (titles as in kvferry_dev/dashboard.py), one per question first.
SHOWN = [
    "Reused share of prompt tokens, turns 2+",
    "Turn outcomes",
    "NIXL bandwidth",
    "Prefill leg with a pull, p50 / p95",
    "Inter-turn gap vs retention",
    "Handle fates",
    "TTFT p50 / p95 / p99 by reuse",
    "Pinned KV",
    "KV cache usage and preemptions (engine)",
    "Retention: applied and recommended",
    "Time before the first engine request, p95",
    "Sidecar CPU",
]


DASHBOARD = (
    Path(__file__).resolve().parents[1] / "charts" / "kvferry" / "dashboards" / "kvferry.json"
)


def legends() -> dict[str, str]:
    board = json.loads(DASHBOARD.read_text())
    return {
        t["expr"]: t.get("legendFormat", "") for p in board["panels"] for t in p.get("targets", [])
    }


def label(legend: str, metric: dict[str, str]) -> str:
    return re.sub(r"\{\{(\w+)\}\}", lambda m: metric.get(m.group(1), ""), legend) or "value"


def main(src: str, out: str) -> None:
    data = json.loads(Path(src).read_text())
    start = data["start"]
    legend_of = legends()
    panels: dict[str, list] = {}
    for p in data["panels"]:
        legend = legend_of.get(p.get("expr", ""), "")
        panels.setdefault(p["title"], []).extend((legend, r) for r in p["result"])
    cols = 3
    rows = math.ceil(len(SHOWN) / cols)
    fig, axes = plt.subplots(rows, cols, figsize=(16, 3.2 * rows), constrained_layout=True)
    for ax, title in zip(axes.flat, SHOWN, strict=False):
        for legend, series in panels.get(title, []):
            points = [(t - start, float(v)) for t, v in series["values"] if v != "NaN"]
            if points:
                xs, ys = zip(*points, strict=True)
                ax.plot(xs, ys, label=label(legend, series["metric"]), linewidth=1.2)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("seconds into the run", fontsize=8)
        ax.tick_params(labelsize=8)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7, loc="best")
    for ax in list(axes.flat)[len(SHOWN) :]:
        ax.axis("off")
    fig.suptitle(
        "kvferry dashboard panels, engine-tier run (vLLM-cpu P/D, NIXL over UCX tcp)",
        fontsize=12,
    )
    fig.savefig(out, dpi=80)
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
