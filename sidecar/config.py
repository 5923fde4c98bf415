"""Sidecar settings: defaults < settings file < topology file < environment < flags.

The operator mounts two files from the ConfigMap ``<server>-sidecar``:
``sidecar.json`` (settings; a change restarts the pods) and ``topology.json``
(``prefillEngines`` and ``decodeSidecars`` by ordinal; re-read live, so scaling does
not restart anything). Both are ``kvferry_wire.settings.SettingsFile``: what a file
may say, its keys and defaults are defined there once, for the operator and for this
reader. Unknown keys are ignored (logged at DEBUG) so an older sidecar accepts a newer
operator's file.

``Settings`` adds what only the pod knows (its name and namespace, where the files
are). Every field has an environment twin ``KVFERRY_<FIELD>`` (``env_name``) and a
flag ``--<field-with-dashes>`` (``flag_names``, with a few short names kept).
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final

import msgspec
import yaml

from kvferry_wire import settings as wire
from kvferry_wire.jsondepth import nested_deeper_than, value_deeper_than
from kvferry_wire.policy import PLACEMENTS
from kvferry_wire.protocol import ROLE_DECODE as ROLE_DECODE  # re-exported: app, metrics, runtime
from kvferry_wire.protocol import ROLES
from kvferry_wire.settings import DEFAULT_SESSION_KEYS as DEFAULT_SESSION_KEYS
from kvferry_wire.settings import SETTINGS_VERSION

log = logging.getLogger(__name__)

ConfigError = wire.SettingsError


class Settings(wire.SidecarSettings, frozen=True, kw_only=True):
    """A pod's settings: the file's fields and what only the pod knows."""

    # Identity for the report: the operator sets KVFERRY_SERVER; POD_NAME /
    # POD_NAMESPACE come from the downward API.
    pod_name: str | None = None
    namespace: str | None = None
    settings_path: str | None = None
    topology_path: str | None = None

    @property
    def retention_ceiling(self) -> float:
        """D's decoder_kv_blocks_ttl: the longest any policy may hold a handle."""
        ceiling = self.retention_ceiling_seconds
        return self.retention_seconds if ceiling is None else ceiling

    @property
    def forwarding(self) -> bool:
        return self.ordinal is not None and len(self.decode_sidecars) > 1


FIELDS: Final = tuple(f.name for f in msgspec.structs.fields(Settings))
# One layer (environment, flags) by field name, each field unset unless given.
_Layer = wire.partial(Settings, "SettingsLayer")
# The short flag names the console script has always had, besides --<field>.
_SHORT_FLAGS: Final = {
    "settings_path": ("--config",),
    "topology_path": ("--topology",),
    "listen_host": ("--host",),
    "listen_port": ("--port",),
}


def env_name(name: str) -> str:
    """The environment twin of a field."""
    return "KVFERRY_" + name.upper()


# Settings an earlier release read, with why they are gone: named in a warning rather
# than ignored in silence (docs/upgrading.md). Field name -> reason.
REMOVED: Final = {
    "expiry_margin_seconds": (
        "the handle-expiry margin is kvferry_wire.protocol.HANDLE_EXPIRY_MARGIN_SECONDS, "
        "the value the operator's tuner assumes"
    ),
}
_REMOVED_FILE_KEYS: Final = {wire.file_key(name): name for name in REMOVED}


def flag_names(name: str) -> tuple[str, ...]:
    """The command-line flags of a field (the first is the one help shows)."""
    return (*_SHORT_FLAGS.get(name, ()), "--" + name.replace("_", "-"))


def _layer(values: Mapping[str, Any], origin: Callable[[str], str]) -> dict[str, Any]:
    """Field-name values read leniently; an error names where the bad one came from."""
    out: dict[str, Any] = {}
    for name, value in values.items():
        out |= wire.given(wire.convert({name: value}, _Layer, origin(name)))
    return out


def _from_mapping(data: Mapping[str, Any], origin: str) -> dict[str, Any]:
    for key in wire.unknown_keys(data):
        if key in _REMOVED_FILE_KEYS:
            log.warning(
                "settings key removed, ignored origin=%s key=%s: %s",
                origin,
                key,
                REMOVED[_REMOVED_FILE_KEYS[key]],
            )
        else:
            log.debug("settings key ignored origin=%s key=%s", origin, key)
    out = wire.given(wire.decode_file(data, origin))
    version = out.pop("version", None)
    if isinstance(version, int) and version > SETTINGS_VERSION:
        log.warning(
            "settings file is newer than this sidecar origin=%s version=%s supported=%s",
            origin,
            version,
            SETTINGS_VERSION,
        )
    port = out.pop("engine_port", None)
    if port is not None and "engine_url" not in out:
        out["engine_url"] = f"http://127.0.0.1:{port}"
    return out


# A settings or topology file is a mapping of scalars and lists of strings: two
# levels. Deeper is refused with a SettingsError (TopologyWatch keeps the old
# topology on one), never left to the parser's RecursionError.
MAX_FILE_DEPTH: Final = 16


def load_file(path: str | Path) -> dict[str, Any]:
    """A JSON or YAML settings/topology file as Settings fields."""
    text = Path(path).read_text()
    too_deep = ConfigError(f"{path}: nested deeper than {MAX_FILE_DEPTH} levels")
    if str(path).endswith(".json"):
        if nested_deeper_than(text.encode(), MAX_FILE_DEPTH):
            raise too_deep
        data = json.loads(text)
    else:
        try:
            data = yaml.safe_load(text)
        except RecursionError:
            raise too_deep from None
    if value_deeper_than(data, MAX_FILE_DEPTH):
        raise too_deep
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


def from_env(env: Mapping[str, str]) -> dict[str, Any]:
    """KVFERRY_<FIELD> variables (lists comma-separated)."""
    for name, why in REMOVED.items():
        if env_name(name) in env:
            log.warning("setting removed, ignored env=%s: %s", env_name(name), why)
    raw = {name: env[env_name(name)] for name in FIELDS if env_name(name) in env}
    return _layer(raw, lambda name: f"env {env_name(name)}")


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
    if settings.prefill_placement not in PLACEMENTS:
        raise ConfigError(
            f"prefill_placement must be one of {', '.join(PLACEMENTS)}, "
            f"got {settings.prefill_placement!r}"
        )
    if settings.internal_port and settings.internal_port == settings.listen_port:
        raise ConfigError(
            "internal_port must differ from listen_port (or be 0 to serve internal "
            "routes on listen_port)"
        )
    if settings.metrics_port and settings.metrics_port in (
        settings.listen_port,
        settings.internal_port,
    ):
        raise ConfigError(
            "metrics_port must differ from listen_port and internal_port (or be 0 for none)"
        )
    if settings.handle_store_cap < 1:
        raise ConfigError("handle_store_cap must be >= 1")
    if settings.block_size is not None and settings.block_size < 1:
        raise ConfigError("block_size must be >= 1")
    if settings.retention_seconds <= 0:
        raise ConfigError("retention_seconds must be > 0")
    if settings.retention_ceiling_seconds is not None and settings.retention_ceiling_seconds <= 0:
        raise ConfigError("retention_ceiling_seconds must be > 0")
    if settings.local_handle_seconds <= 0:
        raise ConfigError("local_handle_seconds must be > 0")
    for name in (
        "connect_timeout_seconds",
        "prefill_timeout_seconds",
        "decode_timeout_seconds",
        "stream_idle_timeout_seconds",
        "header_timeout_seconds",
        "body_timeout_seconds",
    ):
        if getattr(settings, name) <= 0:
            raise ConfigError(f"{name} must be > 0")
    for name in ("body_bytes_per_token", "max_messages"):
        if getattr(settings, name) < 1:
            raise ConfigError(f"{name} must be >= 1")
    for name in ("max_inflight_body_bytes", "memory_limit_bytes"):
        if getattr(settings, name) is not None and getattr(settings, name) < 1:
            raise ConfigError(f"{name} must be >= 1")
    for name in ("body_overhead_bytes", "max_media_bytes", "max_content_parts"):
        if getattr(settings, name) < 0:
            raise ConfigError(f"{name} must be >= 0")
    if settings.max_model_len is not None and settings.max_model_len < 1:
        raise ConfigError("max_model_len must be >= 1")
    if settings.drain_seconds < 0:
        raise ConfigError("drain_seconds must be >= 0 (0: stop taking turns and stop at once)")
    if settings.release_after_seconds < 0:
        raise ConfigError("release_after_seconds must be >= 0")
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
    _validate_owners(settings)
    return settings


_HEADER_NAME = re.compile(r"[A-Za-z0-9-]{1,128}")


def _validate_owners(settings: Settings) -> None:
    header = settings.owner_header
    if header and not _HEADER_NAME.fullmatch(header):
        raise ConfigError(
            f"owner_header must be a header name (letters, digits and '-'), got {header!r}"
        )
    if header and header.lower().startswith("x-kvferry-"):
        raise ConfigError(
            f"owner_header {header!r} is one of the sidecar's own headers (X-Kvferry-*): "
            "name the header your gateway sets to the authenticated client"
        )
    for name in ("owner_max_handles", "owner_max_pinned_tokens"):
        value = getattr(settings, name)
        if value is not None and value < 1:
            raise ConfigError(f"{name} must be >= 1")
        if value is not None and not header:
            log.warning(
                "%s is set but owner_header is not: without owners there are no "
                "per-owner caps, only handle_store_cap",
                name,
            )


def build(
    overrides: Mapping[str, Any] | None = None,
    *,
    env: Mapping[str, str] | None = None,
) -> Settings:
    """Settings from files named in overrides/env, then env, then overrides (flags,
    by field name; None = not given)."""
    env = os.environ if env is None else env
    flags = _layer(
        {k: v for k, v in (overrides or {}).items() if v is not None},
        lambda name: f"flag {flag_names(name)[0]}",
    )
    env_values = from_env(env)
    values: dict[str, Any] = {}
    settings_path = flags.get("settings_path") or env_values.get("settings_path")
    topology_path = flags.get("topology_path") or env_values.get("topology_path")
    if settings_path:
        values.update(load_file(settings_path))
    if topology_path:
        values.update(load_file(topology_path))
    values.update(env_values)
    values.update(flags)
    values["settings_path"] = settings_path
    values["topology_path"] = topology_path
    if values.get("ordinal") is None:
        values["ordinal"] = ordinal_from_pod_name(env.get("POD_NAME"))
    if values.get("pod_name") is None:
        values["pod_name"] = env.get("POD_NAME") or None
    if values.get("namespace") is None:
        values["namespace"] = env.get("POD_NAMESPACE") or None
    return validate(Settings(**values))


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
