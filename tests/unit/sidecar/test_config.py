"""Settings: the operator's files, environment, flags, and their precedence."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvferry_sidecar import cli, config
from kvferry_sidecar.config import ConfigError, TopologyWatch

# What operator/render.py writes to sidecar.json and topology.json.
OPERATOR_SETTINGS = {
    "version": 1,
    "server": "llama",
    "model": "meta-llama/Llama-3.3-70B-Instruct",
    "engineBuild": "abc123",
    "enginePort": 8200,
    "listenPort": 8000,
    "bidirectional": True,
    "recomputeThreshold": 64,
    "decodeRetentionSeconds": 480,
    "sessionKeys": ["session_id", "header:X-Session-Id"],
    "skipPrefillBelowTokens": 256,
    "transport": "auto",
    "kvEvents": "tcp://127.0.0.1:5557",
    "kvEventsReplay": "tcp://127.0.0.1:5558",
}
OPERATOR_TOPOLOGY = {
    "version": 1,
    "prefillEngines": ["http://x-prefill-0.x-prefill.ns.svc:8200"],
    "decodeSidecars": [
        "http://x-decode-0.x-decode.ns.svc:8000",
        "http://x-decode-1.x-decode.ns.svc:8000",
    ],
}


@pytest.fixture
def files(tmp_path: Path) -> tuple[Path, Path]:
    settings = tmp_path / "sidecar.json"
    topology = tmp_path / "topology.json"
    settings.write_text(json.dumps(OPERATOR_SETTINGS))
    topology.write_text(json.dumps(OPERATOR_TOPOLOGY))
    return settings, topology


def test_config_reads_operator_files(files: tuple[Path, Path]) -> None:
    """The operator's ConfigMap files map onto every field they name."""
    settings_path, topology_path = files
    s = config.build(
        {"settings_path": str(settings_path), "topology_path": str(topology_path)},
        env={"POD_NAME": "x-decode-1"},
    )
    assert s.engine_url == "http://127.0.0.1:8200"
    assert s.engine_build == "abc123"
    assert s.session_keys == ("session_id", "header:X-Session-Id")
    assert s.retention_seconds == 480.0
    assert s.skip_prefill_below_tokens == 256
    assert s.prefill_engines == ("http://x-prefill-0.x-prefill.ns.svc:8200",)
    assert len(s.decode_sidecars) == 2
    assert s.ordinal == 1
    assert s.forwarding


def test_config_precedence_flags_over_env_over_files(files: tuple[Path, Path]) -> None:
    """A flag beats the environment, which beats the file."""
    settings_path, _ = files
    env = {"KVFERRY_RECOMPUTE_THRESHOLD": "32", "KVFERRY_SKIP_PREFILL_BELOW_TOKENS": "10"}
    s = config.build({"settings_path": str(settings_path), "recompute_threshold": 16}, env=env)
    assert s.recompute_threshold == 16
    assert s.skip_prefill_below_tokens == 10


def test_config_env_lists_are_comma_separated() -> None:
    env = {"KVFERRY_PREFILL_ENGINES": "http://a:1, http://b:2", "KVFERRY_ORDINAL": "0"}
    s = config.build({}, env=env)
    assert s.prefill_engines == ("http://a:1", "http://b:2")
    assert s.ordinal == 0


def test_config_yaml_file(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text("role: prefill\nblockSize: 16\nstreamingHandles: false\n")
    s = config.build({"settings_path": str(path)}, env={})
    assert (s.role, s.block_size, s.streaming_handles) == ("prefill", 16, False)


def test_config_error_names_the_field(tmp_path: Path) -> None:
    """A bad value is reported with the file and the field."""
    path = tmp_path / "sidecar.json"
    path.write_text(json.dumps({"recomputeThreshold": "many"}))
    with pytest.raises(ConfigError, match="recompute_threshold"):
        config.build({"settings_path": str(path)}, env={})


def test_config_rejects_unknown_role() -> None:
    with pytest.raises(ConfigError, match="role"):
        config.build({"role": "router"}, env={})


@pytest.mark.parametrize(
    ("pod", "expected"),
    [("x-decode-0", 0), ("llama-70b-decode-12", 12), ("standalone", None), (None, None)],
)
def test_config_ordinal_from_pod_name(pod: str | None, expected: int | None) -> None:
    assert config.ordinal_from_pod_name(pod) == expected


def test_config_topology_watch_reports_changes_once(files: tuple[Path, Path]) -> None:
    """A topology edit is seen once; an unreadable file keeps the old topology."""
    _, topology_path = files
    watch = TopologyWatch(str(topology_path))
    assert watch.poll() is not None
    assert watch.poll() is None
    topology_path.write_text(json.dumps({**OPERATOR_TOPOLOGY, "prefillEngines": []}))
    assert watch.poll() == ((), tuple(OPERATOR_TOPOLOGY["decodeSidecars"]))
    topology_path.write_text("{not json")
    assert watch.poll() is None


def test_cli_flags(files: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    """The console script's flags reach the settings."""
    settings_path, topology_path = files
    monkeypatch.setenv("POD_NAME", "x-decode-0")
    s = cli.settings_from_args(
        [
            "--role", "decode",
            "--config", str(settings_path),
            "--topology", str(topology_path),
            "--port", "9000",
            "--block-size", "16",
        ]
    )  # fmt: skip
    assert (s.role, s.listen_port, s.block_size, s.ordinal) == ("decode", 9000, 16, 0)


def test_cli_bad_settings_exit_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--role", "decode", "--handle-store-cap", "0"]) == 2
    assert "handle_store_cap" in capsys.readouterr().err


def test_config_reads_residency_settings(files: tuple[Path, Path]) -> None:
    """Reporting settings from the operator's file and the pod's environment."""
    settings_path, _ = files
    data = {
        **OPERATOR_SETTINGS,
        "operatorUrl": "https://kvferry.kvferry-system.svc:8443/v1/reports",
        "operatorCaFile": "/etc/kvferry/ca.crt",
        "reportIntervalSeconds": 30,
    }
    settings_path.write_text(json.dumps(data))
    env = {
        "POD_NAME": "llama-decode-1",
        "POD_NAMESPACE": "serving",
        "KVFERRY_TOKEN_FILE": "/var/run/secrets/kvferry/token",
    }
    s = config.build({"settings_path": str(settings_path)}, env=env)
    assert s.server == "llama"
    assert (s.pod_name, s.namespace) == ("llama-decode-1", "serving")
    assert s.operator_url.endswith(":8443/v1/reports")
    assert s.operator_ca_file == "/etc/kvferry/ca.crt"
    assert s.report_interval_seconds == 30.0
    assert s.token_file == "/var/run/secrets/kvferry/token"
    assert (s.kv_events, s.kv_events_replay) == ("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558")


def test_config_rejects_a_non_http_operator_url() -> None:
    with pytest.raises(ConfigError, match="operator_url"):
        config.build({"operator_url": "kvferry-operator:8443"}, env={})


def test_event_loop_is_uvloop_unless_asked_for_asyncio(monkeypatch) -> None:
    """uvloop when installed (it is a dependency); KVFERRY_SIDECAR_EVENT_LOOP=asyncio
    is the escape hatch."""
    import asyncio

    import uvloop

    loop = cli.new_event_loop()
    try:
        assert isinstance(loop, uvloop.Loop)
    finally:
        loop.close()
    monkeypatch.setenv("KVFERRY_SIDECAR_EVENT_LOOP", "asyncio")
    loop = cli.new_event_loop()
    try:
        assert not isinstance(loop, uvloop.Loop)
        assert isinstance(loop, asyncio.AbstractEventLoop)
    finally:
        loop.close()
