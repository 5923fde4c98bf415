"""Prometheus text exposition -> samples: kvferry's one parser (prometheus_client's).

``enginemetrics`` reads the local engine's figures through it; the dev harness
(``kvferry_dev``) reads engines' and sidecars' ``/metrics`` with ``Scrape``;
``only_families`` keeps the engine's own series for the sidecar's metrics port.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families


@dataclass(frozen=True)
class Sample:
    name: str  # as exposed: counters carry _total, histograms _bucket/_sum/_count
    labels: Mapping[str, str]
    value: float


def samples(text: str) -> Iterator[Sample]:
    """Every sample in ``text``; raises ValueError when it is not the exposition format."""
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            yield Sample(s.name, s.labels, float(s.value))


def is_sample_of(base: str, name: str) -> bool:
    """``name`` is the metric ``base`` itself or, for a counter, ``base_total``."""
    return name in (base, base + "_total")


class Scrape:
    """One ``/metrics`` read, for figures summed over the label sets that match."""

    def __init__(self, text: str) -> None:
        self.samples = list(samples(text))

    def total(self, name: str, **labels: str) -> float:
        """Sum of the samples of ``name`` (a counter's ``name_total`` too) whose labels
        include ``labels``; NaN samples (nothing observed yet) count as 0."""
        return sum(
            s.value
            for s in self.samples
            if is_sample_of(name, s.name)
            and not math.isnan(s.value)
            and all(s.labels.get(k) == v for k, v in labels.items())
        )


def _family_of(line: str) -> str | None:
    """The metric name a line of the text format belongs to (None: another comment)."""
    if line.startswith("# HELP ") or line.startswith("# TYPE "):
        parts = line.split(" ", 3)
        return parts[2] if len(parts) > 2 else None
    if line.startswith("#") or not line.strip():
        return None
    end = len(line)
    for stop in ("{", " "):
        i = line.find(stop)
        if i != -1:
            end = min(end, i)
    return line[:end]


def only_families(text: str, prefix: str) -> str:
    """The lines of ``text`` (the text format) whose metric name starts with ``prefix``,
    HELP and TYPE lines included; one pass, no parse (the text is the engine's own)."""
    kept = [line for line in text.splitlines() if (_family_of(line) or "").startswith(prefix)]
    return "\n".join(kept) + "\n" if kept else ""
