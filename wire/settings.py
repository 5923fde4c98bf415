"""The sidecar's settings and the settings file the operator writes for it.

``SidecarSettings`` is every setting a settings file may carry, with the sidecar's
defaults. ``SettingsFile`` has the same fields, each unset unless given, plus the
file's ``version`` and ``enginePort``: the operator builds one and writes only what it
set (``encode_file``), the sidecar reads a file into one (``decode_file``) so an absent
key falls through to the next layer. Keys are the fields' camelCase names except
``FILE_KEY_EXCEPTIONS``; ``ALIASES`` are older keys still read.

Unknown keys are ignored (``unknown_keys`` names them), so an older sidecar accepts a
newer operator's file. Values are read leniently, as from a person's YAML or an
environment variable (``convert``): numbers and booleans from strings, lists from
comma-separated strings; a value of the wrong type is a ``SettingsError`` that names
the field.
"""

from __future__ import annotations

import re
import types
import typing
from collections.abc import Callable, Mapping
from typing import Any, Final, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

from . import protocol

# The newest settings-file "version" this package describes.
SETTINGS_VERSION: Final = 1

DEFAULT_SESSION_KEYS: Final = (
    "session_id",
    "conversation_id",
    f"header:{protocol.HDR_SESSION_ID}",
    "user",
)

# Fields whose file key is not their camelCase name.
FILE_KEY_EXCEPTIONS: Final = {
    "retention_seconds": "decodeRetentionSeconds",
    "requested_transport": "transport",
}
# Older keys still read -> today's key (today's wins when a file has both).
ALIASES: Final = {"retentionSeconds": "decodeRetentionSeconds"}


class SettingsError(ValueError):
    """Settings a person must fix; the message names the field."""


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


def file_key(name: str) -> str:
    """The settings-file key of a field."""
    return FILE_KEY_EXCEPTIONS.get(name) or _camel(name)


class SidecarSettings(msgspec.Struct, frozen=True, kw_only=True, rename=file_key):
    """Every setting a settings file may carry, with the sidecar's defaults."""

    role: str = protocol.ROLE_DECODE
    listen_host: str = "0.0.0.0"
    listen_port: int = protocol.SIDECAR_PORT
    # Peers, metrics and the residency report; 0 = serve them on listen_port too (a
    # single-port run by hand; the operator always renders both).
    internal_port: int = protocol.SIDECAR_INTERNAL_PORT
    # GET /metrics alone (the sidecar's series and the engine's), for scrapers, who get
    # no peer's rights; 0 = none (a run by hand; the operator renders one).
    metrics_port: int = 0
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
    # The live policy's three (kvferry_wire.policy): what is in force until the
    # operator's first report answer says otherwise, and after it, the operator's.
    skip_prefill_below_tokens: int = 256
    recompute_threshold: int = 64
    # Where a turn's prefill runs (kvferry_wire.policy.PLACEMENTS): Measured chooses
    # per turn between P and D alone from the measured costs and D's load, with
    # skip_prefill_below_tokens until both are measured; Threshold is that rule alone.
    prefill_placement: str = "Measured"
    # How long a decode sidecar holds a handle for the session's next turn.
    retention_seconds: float = 480.0
    # D's decoder_kv_blocks_ttl: D frees a handle's blocks then, whatever the policy
    # says; the retention in force is at most this. None = retention_seconds (a run
    # by hand whose engine was started with that TTL).
    retention_ceiling_seconds: float | None = None
    # D's kv_lease_duration: how long D keeps a turn it prefilled alone (its handle).
    local_handle_seconds: float = 30.0
    handle_store_cap: int = 1024
    # The request header the gateway sets to the authenticated client (the handle's
    # owner); None = no owners (every client shares one store, as before). With it a
    # handle is filed and found under (owner, key), and each owner has its own caps.
    owner_header: str | None = None
    # An owner's kept handles and the tokens they pin, at most; past either its own
    # oldest handle goes. None = derived (kvferry_sidecar.owners.caps): an eighth of
    # handle_store_cap, and an eighth of D's KV (num_gpu_blocks x block_size).
    owner_max_handles: int | None = None
    owner_max_pinned_tokens: int | None = None
    # A handle dropped unread waits this long for a ride on a prefill this sidecar
    # sends anyway (free) before a release request of its own (costs P one block for
    # its KV lease). D pins it meanwhile.
    release_after_seconds: float = 2.0
    # The pin journal (kvferry_sidecar.pinjournal): the file, on the pod's emptyDir,
    # where a decode sidecar notes what D pins for it, so that after a restart it
    # releases what it held. None = none (a run by hand: a restarted sidecar leaves
    # what it held pinned on D until the ceiling).
    pin_journal_path: str | None = None
    # KV block size in tokens; None = read vllm:cache_config_info from the engine.
    # Without it only handles the prompt fully extends are used (no partial prefix).
    block_size: int | None = None
    # None = detect from the engine's /version (0.33+ streams the handle).
    streaming_handles: bool | None = None
    # Tag upstream requests with session_id (the client's, else a digest of the key)
    # so KV events can be attributed to sessions.
    tag_session_id: bool = True
    # The bytes behind a media URL (http, https, file) never change, so a turn whose
    # history holds one may reuse KV. Off: the sidecar cannot see those bytes, and a
    # URL alone in the KV identity would pull the KV of an image since replaced.
    media_urls_immutable: bool = False
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
    # Stopping (GET /drain from the engine's preStop hook, or SIGTERM): how long the
    # turns in flight may take to finish before the engine is let go. The decode
    # budget by default, so a turn whose decode began as the drain started finishes;
    # the operator renders spec.<role>.drainSeconds as --drain-seconds.
    drain_seconds: float = 1800.0
    # Residency reporting (both roles): the server this pod belongs to.
    server: str | None = None
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
    # network.transport and network.rdma.enabled, the engine container's UCX_TLS /
    # UCX_NET_DEVICES (the operator copies them into the sidecar's environment;
    # None = unset) and where RDMA devices show.
    requested_transport: str = "auto"
    rdma_enabled: bool = False
    engine_ucx_tls: str | None = None
    engine_ucx_net_devices: str | None = None
    rdma_sysfs: str = "/sys/class/infiniband"
    topology_reload_seconds: float = 5.0
    # What one request, and all of them together, may cost the sidecar
    # (kvferry_sidecar.limits): a body is read, parsed and copied for each leg, so its
    # memory is many times its size, and the CRD's default sidecar limit is 1 Gi.
    # The context length bodies are measured against; None = the engine's own
    # (max_model_len in its /v1/models).
    max_model_len: int | None = None
    # Bytes of request body (text, JSON escapes included) allowed per token of
    # max_model_len, and a fixed allowance on top for the fields that are no prompt.
    body_bytes_per_token: int = 16
    body_overhead_bytes: int = 1024 * 1024
    # Bytes of media (the strings in image_url, audio_url, video_url, input_audio, ...
    # parts: data: URLs, base64) one request may carry, beside its text.
    max_media_bytes: int = 16 * 1024 * 1024
    # Request bodies held at once across every turn in progress; past it a turn gets
    # 503 with Retry-After. None = derived from memory_limit_bytes
    # (kvferry_sidecar.limits.inflight_capacity; 64 MiB without a limit).
    max_inflight_body_bytes: int | None = None
    # The sidecar container's memory limit: the operator renders it from the downward
    # API (KVFERRY_MEMORY_LIMIT_BYTES, resourceFieldRef limits.memory). None = unknown.
    memory_limit_bytes: int | None = None
    max_messages: int = 4096
    max_content_parts: int = 4096  # in all the messages of one request
    # A connection idle or sending an unfinished request head this long is closed
    # (aiohttp's keep-alive deadline: between requests too). Above the 1 h upstream
    # idle timeout of common gateways (Envoy's default), so the sidecar never closes
    # a pooled connection a gateway is about to reuse (a 503 race); lower it only
    # below the gateway's own idle timeout.
    header_timeout_seconds: float = 3630.0
    # A request body that has not arrived whole this long after its head gets 408.
    body_timeout_seconds: float = 60.0
    log_level: str = "INFO"


S = TypeVar("S", bound=msgspec.Struct)


def partial(
    of: type[msgspec.Struct],
    name: str,
    *,
    rename: Callable[[str], str | None] | None = None,
    extra: tuple[tuple[str, Any], ...] = (),
) -> type[msgspec.Struct]:
    """A struct with ``of``'s fields (and ``extra`` (name, type) pairs), each unset
    unless given: what one source (a file, the environment, the flags) says."""
    fields = [(f.name, f.type | UnsetType, UNSET) for f in msgspec.structs.fields(of)]
    fields += [(field, kind | UnsetType, UNSET) for field, kind in extra]
    return msgspec.defstruct(
        name, fields, kw_only=True, frozen=True, rename=rename, module=__name__
    )


# Derived, not declared: a missing key must fall through to the next layer and the
# operator writes only what it decides, and the field list exists once.
SettingsFile = partial(
    SidecarSettings,
    "SettingsFile",
    rename=file_key,
    extra=(("version", int), ("engine_port", int)),
)
FILE_KEYS: Final = frozenset(f.encode_name for f in msgspec.structs.fields(SettingsFile))


def given(layer: msgspec.Struct) -> dict[str, Any]:
    """A layer's set fields, by field name."""
    return {
        f.name: getattr(layer, f.name)
        for f in msgspec.structs.fields(layer)
        if getattr(layer, f.name) is not UNSET
    }


def encode_file(file: msgspec.Struct) -> dict[str, Any]:
    """A ``SettingsFile`` as the JSON object the operator writes: its set fields only."""
    out: dict[str, Any] = msgspec.json.decode(msgspec.json.encode(file))
    return out


def unknown_keys(data: Mapping[str, Any]) -> list[str]:
    """The keys of a settings file that this package does not describe."""
    return [k for k in data if k not in FILE_KEYS and k not in ALIASES]


def decode_file(data: Mapping[str, Any], origin: str) -> msgspec.Struct:
    """A settings (or topology) file's mapping as a ``SettingsFile``."""
    data = dict(data)
    version = data.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        # Only ever compared, to log a newer file: an odd value must not stop an
        # older sidecar from reading a newer operator's settings.
        data.pop("version", None)
    for old, new in ALIASES.items():
        if old in data:
            value = data.pop(old)
            data.setdefault(new, value)
    return convert(data, SettingsFile, origin)


_AT = re.compile(r"^(?P<what>.*?) - at `\$\.(?P<key>[^`.\[]+)")


def convert(data: Mapping[str, Any], into: type[S], origin: str) -> S:
    """``data`` (keyed as ``into`` encodes its fields) as ``into``, read leniently;
    a ``SettingsError`` names the origin and the field."""
    fields = {f.encode_name: f for f in msgspec.structs.fields(into)}
    loose = {k: _loosen(v, fields[k].type) if k in fields else v for k, v in data.items()}
    try:
        return msgspec.convert(loose, into, strict=False)
    except msgspec.ValidationError as exc:
        match = _AT.match(str(exc))
        if match is None:
            raise SettingsError(f"{origin}: {exc}") from exc
        key = match["key"]
        name = fields[key].name if key in fields else key
        value = f": {data[key]!r}" if key in data else ""
        raise SettingsError(f"{origin}: {name}: {match['what']}{value}") from exc


def _kinds(annotation: Any) -> tuple[set[Any], bool]:
    """(the non-None kinds, whether None is allowed) of a field's type."""
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        args = set(typing.get_args(annotation))
    else:
        args = {annotation}
    args.discard(UnsetType)
    optional = type(None) in args
    args.discard(type(None))
    return {typing.get_origin(a) or a for a in args}, optional


_TRUE = ("true", "1", "yes")
_FALSE = ("false", "0", "no")


def _loosen(value: Any, annotation: Any) -> Any:
    """A value as a person or an environment writes it, moved toward the field's type:
    msgspec's lax mode reads the rest (numbers and booleans from strings)."""
    kinds, optional = _kinds(annotation)
    if tuple in kinds:
        if isinstance(value, str):
            return [v.strip() for v in value.split(",") if v.strip()]
        if isinstance(value, list | tuple):
            return [str(v) for v in value]
        return value
    if not isinstance(value, str):
        if str in kinds and isinstance(value, int | float) and not isinstance(value, bool):
            return str(value)
        return value
    text = value.strip()
    if bool in kinds:
        lowered = text.lower()
        if lowered in _TRUE:
            return True
        if lowered in _FALSE:
            return False
        if optional and lowered in ("auto", ""):
            return None
        return value
    if kinds & {int, float}:
        return text
    return value
