"""Sidecar settings: defaults < settings file < topology file < environment < flags.

The operator mounts two files from the ConfigMap ``<server>-sidecar``:
``sidecar.json`` (settings; a change restarts the pods) and ``topology.json``
(``prefillEngines`` and ``decodeSidecars`` by ordinal; re-read live, so scaling does
not restart anything). Keys are camelCase as the operator writes them; unknown keys
are ignored (logged at DEBUG) so an older sidecar accepts a newer operator's file.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

import yaml

from kvferry_wire import protocol

log = logging.getLogger(__name__)

ROLE_DECODE = "decode"
ROLE_PREFILL = "prefill"
ROLES = (ROLE_DECODE, ROLE_PREFILL)

DEFAULT_SESSION_KEYS = (
    "session_id",
    "conversation_id",
    f"header:{protocol.HDR_SESSION_ID}",
    "user",
)
# The newest settings-file "version" this sidecar understands.
SETTINGS_VERSION = 1


class ConfigError(ValueError):
    """Settings a person must fix; the message names the field."""


@dataclass(frozen=True)
class Settings:
    role: str = ROLE_DECODE
    listen_host: str = "0.0.0.0"
    listen_port: int = protocol.SIDECAR_PORT
    # Peers, metrics and the residency report; 0 = serve them on listen_port too (a
    # single-port run by hand; the operator always renders both).
    internal_port: int = protocol.SIDECAR_INTERNAL_PORT
    # The engine in this pod. The operator sets enginePort; engineUrl overrides.
    engine_url: str = f"http://127.0.0.1:{protocol.ENGINE_PORT}"
    # Prefill engines (vLLM, not sidecars), any order.
    prefill_engines: tuple[str, ...] = ()
    # Decode sidecars indexed by StatefulSet ordinal (the session ring).
    decode_sidecars: tuple[str, ...] = ()
    ordinal: int | None = None  # this pod's ordinal; from POD_NAME when unset
    model: str | None = None
    engine_build: str | None = None  # operator's build hash; handles of another are void
    bidirectional: bool = True
    # X-Kvferry-Outcome/-Route/-Reused-Tokens/-Owner/-Handle on turn responses.
    diagnostic_headers: bool = False
    session_keys: tuple[str, ...] = DEFAULT_SESSION_KEYS
    skip_prefill_below_tokens: int = 256
    recompute_threshold: int = 64  # same as vLLM's kv_recompute_threshold
    retention_seconds: float = 480.0  # D's decoder_kv_blocks_ttl
    # D's kv_lease_duration: how long D keeps a turn it prefilled alone (its handle).
    local_handle_seconds: float = 30.0
    # Drop a handle this long before D frees it (the tuner assumes the same margin).
    expiry_margin_seconds: float = float(protocol.HANDLE_EXPIRY_MARGIN_SECONDS)
    handle_store_cap: int = 1024
    # A handle dropped unread waits this long for a ride on a prefill this sidecar
    # sends anyway (free) before a release request of its own (costs P one block for
    # its KV lease). D pins it meanwhile.
    release_after_seconds: float = 2.0
    # KV block size in tokens; None = read vllm:cache_config_info from the engine.
    # Without it only handles the prompt fully extends are used (no partial prefix).
    block_size: int | None = None
    # None = detect from the engine's /version (0.33+ streams the handle).
    streaming_handles: bool | None = None
    # Tag upstream requests with session_id (the client's, else a digest of the key)
    # so KV events can be attributed to sessions.
    tag_session_id: bool = True
    probe_interval_seconds: float = 2.0
    connect_timeout_seconds: float = 3.0
    # A prefill that takes longer is treated as failed (a pull can hang under
    # kv_load_failure_policy=recompute); long prompts on a busy P need minutes.
    prefill_timeout_seconds: float = 300.0
    # The decode leg as a whole (a non-streamed answer arrives in one piece at the
    # end): long generations need many minutes; a wedged D must not hold a client
    # forever.
    decode_timeout_seconds: float = 1800.0
    # Longest silence between two chunks of a streamed answer.
    stream_idle_timeout_seconds: float = 300.0
    # Residency reporting (both roles). Identity for the report: the operator sets
    # KVFERRY_SERVER; POD_NAME / POD_NAMESPACE come from the downward API.
    server: str | None = None
    pod_name: str | None = None
    namespace: str | None = None
    # POST the report here every report_interval_seconds; "" = do not push.
    operator_url: str = ""
    operator_ca_file: str | None = None  # None = the system trust store
    # The projected ServiceAccount token (audience kvferry), re-read on every push.
    token_file: str | None = None
    report_interval_seconds: float = 15.0
    # The local engine's KV-event PUB and replay ROUTER sockets; "" = off.
    kv_events: str = f"tcp://127.0.0.1:{protocol.KV_EVENTS_PORT}"
    kv_events_replay: str = f"tcp://127.0.0.1:{protocol.KV_EVENTS_REPLAY_PORT}"
    # What the transport report rests on (kvferry_sidecar.transport): the spec's
    # network.transport and network.rdma.enabled (settings file), the engine
    # container's UCX_TLS / UCX_NET_DEVICES (the operator copies them into this
    # container's environment; None = unset) and where RDMA devices show.
    requested_transport: str = "auto"
    rdma_enabled: bool = False
    engine_ucx_tls: str | None = None
    engine_ucx_net_devices: str | None = None
    rdma_sysfs: str = "/sys/class/infiniband"
    settings_path: str | None = None
    topology_path: str | None = None
    topology_reload_seconds: float = 5.0
    log_level: str = "INFO"

    @property
    def forwarding(self) -> bool:
        return self.ordinal is not None and len(self.decode_sidecars) > 1


# camelCase file/env key -> Settings field.
_FILE_KEYS: dict[str, str] = {
    "role": "role",
    "listenHost": "listen_host",
    "listenPort": "listen_port",
    "internalPort": "internal_port",
    "engineUrl": "engine_url",
    "prefillEngines": "prefill_engines",
    "decodeSidecars": "decode_sidecars",
    "ordinal": "ordinal",
    "model": "model",
    "engineBuild": "engine_build",
    "bidirectional": "bidirectional",
    "diagnosticHeaders": "diagnostic_headers",
    "sessionKeys": "session_keys",
    "skipPrefillBelowTokens": "skip_prefill_below_tokens",
    "recomputeThreshold": "recompute_threshold",
    "decodeRetentionSeconds": "retention_seconds",
    "localHandleSeconds": "local_handle_seconds",
    "retentionSeconds": "retention_seconds",
    "expiryMarginSeconds": "expiry_margin_seconds",
    "handleStoreCap": "handle_store_cap",
    "releaseAfterSeconds": "release_after_seconds",
    "blockSize": "block_size",
    "streamingHandles": "streaming_handles",
    "tagSessionId": "tag_session_id",
    "probeIntervalSeconds": "probe_interval_seconds",
    "connectTimeoutSeconds": "connect_timeout_seconds",
    "prefillTimeoutSeconds": "prefill_timeout_seconds",
    "decodeTimeoutSeconds": "decode_timeout_seconds",
    "streamIdleTimeoutSeconds": "stream_idle_timeout_seconds",
    "topologyReloadSeconds": "topology_reload_seconds",
    "logLevel": "log_level",
    "server": "server",
    "operatorUrl": "operator_url",
    "operatorCaFile": "operator_ca_file",
    "tokenFile": "token_file",
    "reportIntervalSeconds": "report_interval_seconds",
    "kvEvents": "kv_events",
    "kvEventsReplay": "kv_events_replay",
    "transport": "requested_transport",
    "rdmaEnabled": "rdma_enabled",
    "engineUcxTls": "engine_ucx_tls",
    "engineUcxNetDevices": "engine_ucx_net_devices",
    "rdmaSysfs": "rdma_sysfs",
}
# Keys the operator writes that the proxy path does not use (yet).
_KNOWN_UNUSED = {"version", "enginePort"}
_FIELD_TYPES = {f.name: f.type for f in fields(Settings)}


def _coerce(name: str, value: Any, origin: str) -> Any:
    kind = str(_FIELD_TYPES[name])
    where = f"{origin}: {name}"
    if value is None:
        if "None" in kind:
            return None
        raise ConfigError(f"{where} must not be null")
    try:
        if kind.startswith("tuple"):
            if isinstance(value, str):
                value = [v.strip() for v in value.split(",") if v.strip()]
            if not isinstance(value, Sequence):
                raise TypeError("expected a list")
            return tuple(str(v) for v in value)
        if kind.startswith("bool"):
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("true", "1", "yes"):
                return True
            if text in ("false", "0", "no"):
                return False
            if text in ("auto", "") and "None" in kind:
                return None
            raise ValueError(f"expected true or false, got {value!r}")
        if kind.startswith("int"):
            if isinstance(value, bool):
                raise TypeError("expected an integer")
            return int(value)
        if kind.startswith("float"):
            return float(value)
        return str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from exc


def _from_mapping(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = _FILE_KEYS.get(key)
        if name is None:
            if key not in _KNOWN_UNUSED:
                log.debug("settings key ignored origin=%s key=%s", origin, key)
            continue
        out[name] = _coerce(name, value, origin)
    version = data.get("version")
    if isinstance(version, int) and version > SETTINGS_VERSION:
        log.warning(
            "settings file is newer than this sidecar origin=%s version=%s supported=%s",
            origin,
            version,
            SETTINGS_VERSION,
        )
    if "enginePort" in data and "engineUrl" not in data:
        port = _coerce("listen_port", data["enginePort"], origin)
        out["engine_url"] = f"http://127.0.0.1:{port}"
    return out


def load_file(path: str | Path) -> dict[str, Any]:
    """A JSON or YAML settings/topology file as Settings fields."""
    text = Path(path).read_text()
    data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    if data is None:
        return {}
    if not isinstance(data, Mapping):
        raise ConfigError(f"{path}: expected a mapping at the top level")
    return _from_mapping(data, str(path))


def load_topology(path: str | Path) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(prefill engines, decode sidecars) from a topology file."""
    values = load_file(path)
    return (
        tuple(values.get("prefill_engines", ())),
        tuple(values.get("decode_sidecars", ())),
    )


_ENV_PREFIX = "KVFERRY_"


def _env_name(field_name: str) -> str:
    return _ENV_PREFIX + field_name.upper()


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """KVFERRY_<FIELD> variables (lists comma-separated)."""
    out: dict[str, Any] = {}
    for name in _FIELD_TYPES:
        raw = env.get(_env_name(name))
        if raw is not None:
            out[name] = _coerce(name, raw, f"env {_env_name(name)}")
    return out


_ORDINAL_RE = re.compile(r"-(\d+)$")


def ordinal_from_pod_name(pod_name: str | None) -> int | None:
    """StatefulSet pods are named <set>-<ordinal>."""
    if not pod_name:
        return None
    match = _ORDINAL_RE.search(pod_name)
    return int(match.group(1)) if match else None


def validate(settings: Settings) -> Settings:
    if settings.role not in ROLES:
        raise ConfigError(f"role must be one of {', '.join(ROLES)}, got {settings.role!r}")
    for name in ("skip_prefill_below_tokens", "recompute_threshold"):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{name} must be >= 0")
    if settings.internal_port and settings.internal_port == settings.listen_port:
        raise ConfigError(
            "internal_port must differ from listen_port (or be 0 to serve internal "
            "routes on listen_port)"
        )
    if settings.handle_store_cap < 1:
        raise ConfigError("handle_store_cap must be >= 1")
    if settings.block_size is not None and settings.block_size < 1:
        raise ConfigError("block_size must be >= 1")
    if settings.retention_seconds <= 0:
        raise ConfigError("retention_seconds must be > 0")
    if settings.local_handle_seconds <= 0:
        raise ConfigError("local_handle_seconds must be > 0")
    for name in (
        "connect_timeout_seconds",
        "prefill_timeout_seconds",
        "decode_timeout_seconds",
        "stream_idle_timeout_seconds",
    ):
        if getattr(settings, name) <= 0:
            raise ConfigError(f"{name} must be > 0")
    if settings.release_after_seconds < 0:
        raise ConfigError("release_after_seconds must be >= 0")
    if settings.expiry_margin_seconds < 0:
        raise ConfigError("expiry_margin_seconds must be >= 0")
    if settings.report_interval_seconds <= 0:
        raise ConfigError("report_interval_seconds must be > 0")
    if settings.requested_transport not in ("auto", "rdma", "tcp"):
        raise ConfigError(
            f"transport must be auto, rdma or tcp, got {settings.requested_transport!r}"
        )
    if settings.operator_url and not settings.operator_url.startswith(("https://", "http://")):
        raise ConfigError(f"operator_url must be an http(s) URL, got {settings.operator_url!r}")
    ring = len(settings.decode_sidecars)
    if settings.ordinal is not None and ring and not 0 <= settings.ordinal < ring:
        log.warning(
            "own ordinal outside the decode ring; serving every session here ordinal=%s ring=%s",
            settings.ordinal,
            ring,
        )
    for key in settings.session_keys:
        if key.startswith("header:") and len(key) == len("header:"):
            raise ConfigError("session_keys: 'header:' needs a header name")
    return settings


def build(
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Settings from files named in overrides/env, then env, then overrides (flags)."""
    env = os.environ if env is None else env
    overrides = dict(overrides or {})
    env_values = from_env(env)
    values: dict[str, Any] = {}
    settings_path = overrides.get("settings_path") or env_values.get("settings_path")
    topology_path = overrides.get("topology_path") or env_values.get("topology_path")
    if settings_path:
        values.update(load_file(settings_path))
    if topology_path:
        values.update(load_file(topology_path))
    values.update(env_values)
    values.update({k: v for k, v in overrides.items() if v is not None})
    values["settings_path"] = settings_path
    values["topology_path"] = topology_path
    if values.get("ordinal") is None:
        values["ordinal"] = ordinal_from_pod_name(env.get("POD_NAME"))
    if values.get("pod_name") is None:
        values["pod_name"] = env.get("POD_NAME") or None
    if values.get("namespace") is None:
        values["namespace"] = env.get("POD_NAMESPACE") or None
    values = {k: _coerce(k, v, "settings") if k in _FIELD_TYPES else v for k, v in values.items()}
    return validate(Settings(**values))


def with_topology(
    settings: Settings, prefill_engines: Sequence[str], decode_sidecars: Sequence[str]
) -> Settings:
    return replace(
        settings, prefill_engines=tuple(prefill_engines), decode_sidecars=tuple(decode_sidecars)
    )


@dataclass
class TopologyWatch:
    """Remembers the last topology file content so a reload acts only on change."""

    path: str
    last: tuple[tuple[str, ...], tuple[str, ...]] | None = field(default=None)

    def poll(self) -> tuple[tuple[str, ...], tuple[str, ...]] | None:
        """The new topology when it changed since the last poll, else None."""
        try:
            current = load_topology(self.path)
        except (OSError, ValueError) as exc:
            log.warning("topology unreadable, keeping the old one path=%s err=%s", self.path, exc)
            return None
        if current == self.last:
            return None
        self.last = current
        return current
