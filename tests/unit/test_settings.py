"""Operator settings from the environment (the chart sets them)."""

from __future__ import annotations

import json
import logging

import pytest

from kvferry_operator import settings


def test_a_removed_variable_is_named_in_a_warning(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("KVFERRY_DEBOUNCE_SECONDS", "0.5")
    with caplog.at_level(logging.WARNING, logger=settings.__name__):
        settings.from_env()
    assert [r.getMessage() for r in caplog.records] == [
        "setting removed, ignored env=KVFERRY_DEBOUNCE_SECONDS: it was read and never used"
    ]


def test_the_defaults_need_no_variable(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in ("KVFERRY_RESYNC_SECONDS", "KVFERRY_REPORT_PORT", "KVFERRY_DEBOUNCE_SECONDS"):
        monkeypatch.delenv(var, raising=False)
    ours = settings.from_env()
    assert (ours.resync_seconds, ours.report_port) == (300.0, 8443)


PROMETHEUS = {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}


def test_metrics_clients_reach_every_servers_policy(monkeypatch: pytest.MonkeyPatch) -> None:
    """KVFERRY_METRICS_CLIENTS (the chart's networkPolicy.metricsClients, as JSON) is
    rendered into every server's NetworkPolicy, on the metrics port."""
    monkeypatch.setenv("KVFERRY_METRICS_CLIENTS", json.dumps([PROMETHEUS]))
    ours = settings.from_env()
    assert ours.render_context().metrics_clients == (PROMETHEUS,)


def test_no_metrics_clients_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("KVFERRY_METRICS_CLIENTS", raising=False)
    assert settings.from_env().render_context().metrics_clients == ()


@pytest.mark.parametrize("value", ["{", '{"a": 1}', "[1]", '[{"podSelector": 1}, 2]'])
def test_bad_metrics_clients_name_the_variable(monkeypatch: pytest.MonkeyPatch, value: str) -> None:
    monkeypatch.setenv("KVFERRY_METRICS_CLIENTS", value)
    with pytest.raises(ValueError, match="KVFERRY_METRICS_CLIENTS"):
        settings.from_env()


def test_the_pod_template_allow_list_is_read_and_none_by_default(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Default refuse: each name gives a server author's pods the node.
    monkeypatch.delenv("KVFERRY_POD_TEMPLATE_ALLOW", raising=False)
    assert settings.from_env().pod_template_allow == frozenset()
    monkeypatch.setenv("KVFERRY_POD_TEMPLATE_ALLOW", "capabilities,privileged")
    assert settings.from_env().pod_template_allow == {"capabilities", "privileged"}
