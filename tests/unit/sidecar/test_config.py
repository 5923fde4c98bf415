"""Settings: the operator's files, environment, flags, and their precedence."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import msgspec
import pytest

from kvferry_sidecar import cli, config
from kvferry_sidecar.config import ConfigError, TopologyWatch
from kvferry_wire import settings as wire_settings

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


@pytest.mark.parametrize("port", [8000, 8001])
def test_the_metrics_port_is_a_port_of_its_own(port: int) -> None:
    """A scraper admitted to the metrics port must not land on a port with more rights."""
    with pytest.raises(ConfigError, match="metrics_port"):
        config.build({"metrics_port": port}, env={})


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


# ------------------------------------------------------------------ one contract


def test_the_rendered_file_is_read_key_for_key(tmp_path: Path) -> None:
    """Every key the operator renders is one the sidecar reads, into the field it
    means (a fact the two sides could otherwise word differently)."""
    from kvferry_operator import api, render
    from tests.manifests import server

    manifest = server({"network": {"transport": "tcp"}, "routing": {"diagnosticHeaders": True}})
    manifest["metadata"]["uid"] = "u"
    ctx = render.Context(report_url="https://op:8443/v1/reports", report_ca_pem="pem")
    rendered = render.build_sidecar_settings(api.parse_server(manifest), ctx)
    assert wire_settings.unknown_keys(rendered) == []
    path = tmp_path / "sidecar.json"
    path.write_text(json.dumps(rendered))
    s = config.build({"settings_path": str(path)}, env={})
    assert s.engine_url == f"http://127.0.0.1:{rendered['enginePort']}"
    assert (s.server, s.model, s.engine_build) == (
        rendered["server"],
        rendered["model"],
        rendered["engineBuild"],
    )
    assert (s.listen_port, s.internal_port) == (rendered["listenPort"], rendered["internalPort"])
    assert s.retention_seconds == rendered["decodeRetentionSeconds"]
    assert s.local_handle_seconds == rendered["localHandleSeconds"]
    assert s.session_keys == tuple(rendered["sessionKeys"])
    assert (s.requested_transport, s.rdma_enabled) == ("tcp", False)
    assert s.diagnostic_headers is True
    assert (s.operator_url, s.operator_ca_file) == (
        "https://op:8443/v1/reports",
        "/etc/kvferry/operator-ca.crt",
    )
    assert (s.kv_events, s.kv_events_replay) == (rendered["kvEvents"], rendered["kvEventsReplay"])
    assert OPERATOR_SETTINGS.keys() <= rendered.keys()


def test_the_operator_writes_only_what_it_set() -> None:
    file = wire_settings.SettingsFile(version=1, retention_seconds=120, session_keys=("a",))
    assert wire_settings.encode_file(file) == {
        "version": 1,
        "decodeRetentionSeconds": 120,
        "sessionKeys": ["a"],
    }


# Every flag and environment variable the sidecar has had: scripts and pods use them.
KEPT_FLAGS = (
    "--role", "--config", "--topology", "--host", "--port", "--internal-port",
    "--engine-url", "--prefill-engines", "--decode-sidecars", "--ordinal", "--model",
    "--engine-build", "--session-keys", "--skip-prefill-below-tokens",
    "--recompute-threshold", "--retention-seconds", "--handle-store-cap", "--block-size",
    "--operator-url", "--operator-ca-file", "--report-interval-seconds", "--kv-events",
    "--kv-events-replay", "--log-level",
)  # fmt: skip
KEPT_FIELDS = (
    "role", "listen_host", "listen_port", "internal_port", "engine_url", "prefill_engines",
    "decode_sidecars", "ordinal", "model", "engine_build", "bidirectional",
    "diagnostic_headers", "session_keys", "skip_prefill_below_tokens", "recompute_threshold",
    "prefill_placement", "retention_seconds", "retention_ceiling_seconds",
    "local_handle_seconds", "handle_store_cap",
    "release_after_seconds", "pin_journal_path",
    "block_size", "streaming_handles", "tag_session_id", "probe_interval_seconds",
    "connect_timeout_seconds", "prefill_timeout_seconds", "decode_timeout_seconds",
    "stream_idle_timeout_seconds", "drain_seconds", "server", "pod_name", "namespace",
    "operator_url", "operator_ca_file", "token_file", "report_interval_seconds", "kv_events",
    "kv_events_replay", "requested_transport", "rdma_enabled", "engine_ucx_tls",
    "engine_ucx_net_devices", "rdma_sysfs", "settings_path", "topology_path",
    "topology_reload_seconds", "log_level", "media_urls_immutable",
    "max_model_len", "body_bytes_per_token", "body_overhead_bytes", "max_media_bytes",
    "max_inflight_body_bytes", "max_messages", "max_content_parts", "header_timeout_seconds",
    "body_timeout_seconds", "owner_header", "owner_max_handles", "owner_max_pinned_tokens",
    "metrics_port", "memory_limit_bytes",
)  # fmt: skip


def test_every_flag_the_sidecar_had_is_kept() -> None:
    known = {opt for action in cli.parser()._actions for opt in action.option_strings}
    assert set(KEPT_FLAGS) <= known


def test_every_setting_has_an_env_twin_and_a_flag() -> None:
    """The environment and the flags are derived from the one type: every field has
    both, and the fields the sidecar had are all still there."""
    assert set(KEPT_FIELDS) == set(config.FIELDS)
    dests = {a.dest for a in cli.parser()._actions if a.option_strings and a.dest != "help"}
    assert dests == set(config.FIELDS)
    samples = {"str": "x", "int": "7", "float": "7.5", "bool": "false", "tuple": "a,b"}
    for f in msgspec.structs.fields(config.Settings):
        kind = next(k for k in samples if k in str(f.type))
        assert f.name in config.from_env({config.env_name(f.name): samples[kind]}), f.name
        args = vars(cli.parser().parse_args([config.flag_names(f.name)[-1], "prefill"]))
        assert args[f.name] == "prefill"


def test_the_expiry_margin_is_the_wire_constant_not_a_setting() -> None:
    """The operator's tuner adds protocol.HANDLE_EXPIRY_MARGIN_SECONDS back: a pod
    with another margin would make its recommendations wrong."""
    assert "expiry_margin_seconds" not in config.FIELDS
    assert "expiryMarginSeconds" in wire_settings.unknown_keys({"expiryMarginSeconds": 1})
    with pytest.raises(SystemExit):
        cli.parser().parse_args(["--expiry-margin-seconds", "1"])


def test_env_and_flag_errors_name_where_and_the_field(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ConfigError, match=r"env KVFERRY_BLOCK_SIZE: block_size: .*'many'"):
        config.build({}, env={"KVFERRY_BLOCK_SIZE": "many"})
    with pytest.raises(ConfigError, match=r"env KVFERRY_BIDIRECTIONAL: bidirectional: .*'maybe'"):
        config.build({}, env={"KVFERRY_BIDIRECTIONAL": "maybe"})
    assert cli.main(["--block-size", "many"]) == 2
    assert "flag --block-size: block_size" in capsys.readouterr().err
    with pytest.raises(ConfigError, match="flag --port: listen_port"):
        config.build({"listen_port": "x"}, env={})


def test_file_values_are_read_as_a_person_writes_them(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.yaml"
    path.write_text(
        "sessionKeys: 'user, session_id'\nstreamingHandles: auto\ntagSessionId: 'no'\n"
        "recomputeThreshold: '32'\nretentionSeconds: 60\nmodel: 7\n"
    )
    s = config.build({"settings_path": str(path)}, env={"KVFERRY_BIDIRECTIONAL": "Yes"})
    assert s.session_keys == ("user", "session_id")
    assert (s.streaming_handles, s.tag_session_id, s.bidirectional) == (None, False, True)
    assert (s.recompute_threshold, s.retention_seconds, s.model) == (32, 60.0, "7")


def test_the_current_key_wins_over_its_alias(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.json"
    path.write_text(json.dumps({"retentionSeconds": 60, "decodeRetentionSeconds": 90}))
    assert config.build({"settings_path": str(path)}, env={}).retention_seconds == 90.0


def test_null_where_a_value_is_needed_names_the_field(tmp_path: Path) -> None:
    path = tmp_path / "sidecar.json"
    path.write_text(json.dumps({"listenPort": None}))
    with pytest.raises(ConfigError, match=f"{path}: listen_port: Expected `int`, got `null`: None"):
        config.build({"settings_path": str(path)}, env={})


def test_unknown_keys_are_ignored_and_a_newer_file_is_warned_of(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """An older sidecar reads a newer operator's file: it says so, and goes on."""
    path = tmp_path / "sidecar.json"
    path.write_text(json.dumps({"version": 2, "someNewKey": {"a": 1}, "blockSize": 16}))
    with caplog.at_level(logging.DEBUG, logger="kvferry_sidecar.config"):
        s = config.build({"settings_path": str(path)}, env={})
    assert s.block_size == 16
    assert "key=someNewKey" in caplog.text
    assert "settings file is newer than this sidecar" in caplog.text


@pytest.mark.parametrize("version", ["v1", 2.5, True, None])
def test_an_odd_file_version_never_stops_the_sidecar(tmp_path: Path, version: object) -> None:
    """``version`` is only compared, to warn of a newer file: an unreadable one is
    ignored, so an older sidecar still reads a newer operator's settings."""
    path = tmp_path / "sidecar.json"
    path.write_text(json.dumps({"version": version, "role": "prefill"}))
    assert config.build({"settings_path": str(path)}, env={}).role == "prefill"


def test_a_removed_setting_is_named_in_a_warning(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A removed setting is ignored, never silently: the file key and the env var."""
    path = tmp_path / "sidecar.json"
    path.write_text(json.dumps({"expiryMarginSeconds": 30}))
    with caplog.at_level(logging.WARNING, logger=config.__name__):
        config.build({"settings_path": str(path)}, env={"KVFERRY_EXPIRY_MARGIN_SECONDS": "30"})
    removed = [r.getMessage() for r in caplog.records if "removed" in r.getMessage()]
    assert len(removed) == 2
    assert "key=expiryMarginSeconds" in removed[0] or "key=expiryMarginSeconds" in removed[1]
    assert any("env=KVFERRY_EXPIRY_MARGIN_SECONDS" in m for m in removed)
    assert all("HANDLE_EXPIRY_MARGIN_SECONDS" in m for m in removed)


DEEP_FILES = [
    ("sidecar.json", '{"prefillEngines": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("sidecar.json", '{"model": ' + '{"a":' * 100_000 + "1" + "}" * 100_000 + "}"),
    ("sidecar.yaml", "prefillEngines: " + "[" * 100_000 + "]" * 100_000),
    ("sidecar.yaml", "model:\n" + "".join(" " * n + "- \n" for n in range(1, 400))),
    ("sidecar.yaml", "model:\n  " + "- " * 5_000 + "x"),
]


@pytest.mark.parametrize(("name", "text"), DEEP_FILES)
def test_a_file_nested_too_deep_is_a_settings_error_not_a_crash(
    tmp_path: Path, name: str, text: str
) -> None:
    """A settings or topology file nested 100,000 deep made the parser raise
    RecursionError: a traceback at start, and a dead background loop on a live
    topology reload (TopologyWatch keeps the old topology on a ValueError alone)."""
    path = tmp_path / name
    path.write_text(text)
    with pytest.raises(ConfigError, match="nested deeper than"):
        config.load_file(path)
    watch = TopologyWatch(str(path))
    assert watch.poll() is None  # logged; the old topology stays


def test_a_file_nested_within_the_limit_is_read(tmp_path: Path) -> None:
    path = tmp_path / "topology.json"
    path.write_text(json.dumps({**OPERATOR_TOPOLOGY, "version": 1}))
    assert config.load_topology(path)[1] == tuple(OPERATOR_TOPOLOGY["decodeSidecars"])
