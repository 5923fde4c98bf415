"""In-process fake vLLM engines (prefill and decode) that record what they received:
the unit tier's engines, and the ones ``bench/`` and ``hack/sidecar_load.py`` serve on
real ports.

Shapes follow vLLM 0.32/0.33's OpenAI server: ``/tokenize`` -> ``tokens``; chat and
completions answers with ``prompt_token_ids`` / ``choices[].token_ids`` when
``return_token_ids`` is set and ``kv_transfer_params`` as NixlConnector returns them
(P: ``do_remote_prefill=true`` + its blocks; D: the bidirectional handle with
``remote_blocks_expiry_time`` on D's ``perf_counter`` clock). 0.32 sends no
``kv_transfer_params`` in streamed chunks; 0.33 puts them on the final chunk.

Tokenizer: whitespace words, one shared vocabulary, a chat template of
``<role> words... <eos>`` per message plus ``<assistant>`` as the generation prompt,
so a follow-up turn's prompt extends the previous prompt + answer exactly.

The flags a decode answer depends on (``stream``, ``return_token_ids``) are read with
pydantic in lax mode, as vLLM's request models read them (``"false"`` is false, a
value pydantic refuses is a 400), not by the sidecar's own reading of them.

Opt-in, ``KVReads`` (one object watching the fake P and D engines together): every
handle the engines issued and its one use, as vLLM's NIXL connector frees a handle
after its first read or empty pull. A handle presented again (or one that expired,
was never issued, or whose engine restarted since) is a *re-read*: counted
(``rereads``) and answered 200 with another text (``GARBAGE``), as vLLM #52234 answers
a consumed or stale handle. Without it the fakes behave as before.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from multidict import CIMultiDict
from packaging.version import Version
from pydantic import TypeAdapter, ValidationError

EOS = "<eos>"
VOCAB: dict[str, int] = {"<system>": 1, "<user>": 2, "<assistant>": 3, EOS: 4, "<tool>": 5}


def token_id(word: str) -> int:
    if word not in VOCAB:
        VOCAB[word] = 100 + len(VOCAB)
    return VOCAB[word]


def ids(words: list[str]) -> list[int]:
    return [token_id(w) for w in words]


def chat_words(messages: list[dict[str, Any]], add_generation_prompt: bool = True) -> list[str]:
    words: list[str] = []
    for m in messages:
        words += [f"<{m['role']}>", *str(m.get("content") or "").split(), EOS]
    if add_generation_prompt:
        words.append("<assistant>")
    return words


def chat_ids(messages: list[dict[str, Any]]) -> list[int]:
    return ids(chat_words(messages))


class BadRequest(ValueError):
    """A body vLLM would refuse with a 400 (the fake does the same)."""


_FLAG = TypeAdapter(bool | None)


def vllm_flag(body: dict[str, Any], name: str) -> bool:
    """An optional bool field as vLLM's pydantic request model reads it."""
    try:
        return bool(_FLAG.validate_python(body.get(name)))
    except ValidationError as exc:
        raise BadRequest(f"{name}: {exc.errors()[0]['msg']}") from None


def check_shapes(body: dict[str, Any]) -> None:
    """The fields the fake echoes or reads while streaming, typed as vLLM's request
    model types them (``model: str | None``, ``stream_options: StreamOptions |
    None``): refused before an answer starts, as vLLM refuses them."""
    if not isinstance(body.get("model"), str | None):
        raise BadRequest("model: Input should be a valid string")
    if not isinstance(body.get("stream_options"), dict | None):
        raise BadRequest("stream_options: Input should be a valid dictionary")


def prompt_words(body: dict[str, Any]) -> list[str]:
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise BadRequest("messages must be a list of objects with a role")
        return chat_words(messages, body.get("add_generation_prompt", True))
    prompt = body.get("prompt", "")
    if isinstance(prompt, list) and all(isinstance(t, int) for t in prompt):
        # Token ids (the sidecar's re-anchor request): back to the shared vocabulary.
        words = {v: k for k, v in VOCAB.items()}
        return [words.get(t, f"<{t}>") for t in prompt]
    return str(prompt).split()


# A field of the wrong type where the fake reads it (a string for stream_options, a
# number for a message's content): vLLM's request model refuses such a body with a
# 400 before any work, and so does the fake, without modelling every field's type.
_WRONG_TYPE = (AttributeError, TypeError, KeyError)

_ARRIVALS = itertools.count()


@dataclass
class Seen:
    path: str
    headers: CIMultiDict[str]
    body: dict[str, Any]
    # Arrival order across every fake engine in the process.
    seq: int = field(default_factory=lambda: next(_ARRIVALS))


def has_handle(body: dict[str, Any]) -> bool:
    params = body.get("kv_transfer_params") or {}
    return bool(params.get("do_remote_decode") and params.get("remote_block_ids"))


# What a fake engine answers when it read KV it should not have (KVReads): 200, and
# not the answer the prompt gets without reuse.
GARBAGE = "garbage read from a used handle"

# How a handle was used (KVReads): P pulled D's blocks, P registered an empty pull (a
# release), D read P's blocks (the decode leg, or the anchor of a 0.32 stream).
USE_PULL = "pull"
USE_RELEASE = "release"
USE_DECODE = "decode"
# Why a first use is a re-read all the same.
STALE_NEVER_ISSUED = "never issued"
STALE_RESTARTED = "its engine restarted"
STALE_EXPIRED = "expired"

HandleKey = tuple[str, str, int]


def handle_key(params: Any) -> HandleKey | None:
    """(engine id, request id, first block id) of the blocks ``params`` name, or None
    when they name none. The first block survives the sidecar's alignment cut, and
    the fake D's block ids differ for every request it answers."""
    if not isinstance(params, Mapping):
        return None
    blocks = params.get("remote_block_ids")
    if isinstance(blocks, list) and blocks and isinstance(blocks[0], list):
        blocks = blocks[0]
    if not isinstance(blocks, list) or not blocks or not isinstance(blocks[0], int):
        return None
    return (str(params.get("remote_engine_id")), str(params.get("remote_request_id")), blocks[0])


@dataclass(frozen=True)
class Reread:
    """A handle presented after its one use (or stale): what, how, and by whom."""

    key: HandleKey
    first: str  # the first use (USE_*), or why it was stale (STALE_*)
    then: str  # this use (USE_*)
    engine: str  # the engine it was presented to


@dataclass
class _Issued:
    engine: FakeEngine
    started_at: float  # the engine's process start when it issued the handle
    expiry: float | None  # remote_blocks_expiry_time (perf_counter), None: a lease
    poisoned: bool  # computed from a re-read: the KV behind it is garbage


@dataclass
class KVReads:
    """Every handle the watched fake engines issued, and its one use (module doc).
    ``clock``: the clock D stamps expiry times with (a test's ``FakeClock``)."""

    clock: Callable[[], float] = time.perf_counter
    rereads: int = 0
    log: list[Reread] = field(default_factory=list)
    uses: dict[HandleKey, str] = field(default_factory=dict)
    issued: dict[HandleKey, _Issued] = field(default_factory=dict)

    def watch(self, *engines: FakeEngine) -> KVReads:
        for engine in engines:
            engine.kv_reads = self
        return self

    def count(self, how: str) -> int:
        """First uses of one kind (USE_*)."""
        return sum(1 for used in self.uses.values() if used == how)

    def issue(self, engine: FakeEngine, params: Mapping[str, Any], *, poisoned: bool) -> None:
        key = handle_key(params)
        if key is None:
            return
        expiry = params.get("remote_blocks_expiry_time")
        self.issued[key] = _Issued(
            engine, engine.started_at, expiry if isinstance(expiry, float) else None, poisoned
        )
        self.uses.pop(key, None)  # a new handle under that name (never in vLLM)

    def use(self, engine: FakeEngine, params: Any) -> bool:
        """``engine`` was presented the blocks ``params`` name (if any): True when what
        it reads is garbage (a re-read, or blocks computed from one)."""
        key = handle_key(params)
        if key is None:
            return False
        if engine.role == "prefill":
            release = params.get("remote_num_tokens") == 0
            how = USE_RELEASE if release else USE_PULL
        else:
            how = USE_DECODE
        issued = self.issued.get(key)
        stale = self.uses.get(key)
        if stale is None and issued is None:
            stale = STALE_NEVER_ISSUED
        elif stale is None and issued is not None:
            if issued.engine.started_at != issued.started_at:
                stale = STALE_RESTARTED
            elif issued.expiry is not None and self.clock() >= issued.expiry:
                stale = STALE_EXPIRED
        if stale is not None:
            self.rereads += 1
            self.log.append(Reread(key, stale, how, engine.name))
            return how != USE_RELEASE
        self.uses[key] = how
        return issued is not None and issued.poisoned


@dataclass
class FakeEngine:
    role: str  # "prefill" | "decode"
    name: str
    version: str = "0.33.0"
    block_size: int = 4
    num_gpu_blocks: int = 1024  # in cache_config_info, as vLLM reports its KV size
    max_model_len: int = 4096  # in /v1/models, as vLLM lists it
    hash_algo: str = "sha256_cbor"
    # process_start_time_seconds: the engine's identity (a restart changes it).
    started_at: float = field(default_factory=time.time)
    reply: str = "fine thanks"
    ttl: float = 480.0
    healthy: bool = True
    # Statuses the next completion requests answer with, first to last.
    fail_statuses: list[int] = field(default_factory=list)
    # Prefill: status answered when a request carries a handle (a failed pull).
    fail_with_handle: int | None = None
    # Decode: status answered when a request carries P's params (a failed pull from P).
    fail_with_prefill_params: int | None = None
    omit_params: bool = False
    # 0.33's remote_registration_generation: bumped when the engine re-registers its KV.
    registration_generation: int = 0
    # Completion requests to answer by closing the connection (an engine dying).
    drop_connections: int = 0
    delay: float = 0.0
    # Decode: a one-token request over token ids (a streamed turn's re-anchor) waits
    # for this to be set before it is answered.
    hold_reanchor: asyncio.Event | None = None
    # Streams: silence before the last chunk (a wedged engine).
    stall: float = 0.0
    # Streams: after the chunk with finish_reason, wait for this before the rest.
    hold_after_finish: asyncio.Event | None = None
    # Requests whose caller went away before the answer was done, and their
    # X-Request-Id (vLLM frees an aborted request's KV: it leaves no handle).
    aborted: int = 0
    aborted_ids: list[str] = field(default_factory=list)
    # More /metrics text (vLLM series), appended after cache_config_info.
    metrics_text: str = ""
    seen: list[Seen] = field(default_factory=list)
    # Decode: every handle returned, in order (None when the request got none).
    handles: list[dict[str, Any] | None] = field(default_factory=list)
    # When each of them was returned (perf_counter, as the handles' expiry times).
    handles_at: list[float] = field(default_factory=list)
    url: str = ""
    # Opt-in: the handles issued and used, re-reads counted and answered with garbage.
    kv_reads: KVReads | None = None
    _count: int = 0
    # Set on every abort; waiters clear it before they wait again.
    _aborts: asyncio.Event = field(default_factory=asyncio.Event, repr=False)
    # Set on every completion request received (as _aborts).
    _received: asyncio.Event = field(default_factory=asyncio.Event, repr=False)

    def restart(self) -> None:
        """A new engine process on the same port (its pinned blocks are gone)."""
        self.started_at += 1.0

    # -------------------------------------------------------------- inspection

    def completions(self) -> list[Seen]:
        return [s for s in self.seen if s.path.startswith("/v1/") and s.path != "/v1/models"]

    def last(self) -> Seen:
        return self.completions()[-1]

    async def wait_received(self, count: int = 1) -> None:
        """Return once `count` completion requests have arrived (their bodies read)."""
        while self._count < count:
            self._received.clear()
            await self._received.wait()

    async def wait_aborted(self, count: int = 1) -> None:
        """Return once `count` requests have been aborted by their caller."""
        while self.aborted < count:
            self._aborts.clear()
            await self._aborts.wait()

    # -------------------------------------------------------------- the app

    def app(self) -> web.Application:
        # vLLM reads bodies of any size (aiohttp refuses past 1 MiB by default).
        app = web.Application(client_max_size=256 * 2**20)
        app.router.add_get("/health", self._health)
        app.router.add_get("/version", self._version)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/tokenize", self._tokenize)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/completions", self._complete)
        return app

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(status=200 if self.healthy else 503)

    async def _version(self, request: web.Request) -> web.Response:
        return web.json_response({"version": self.version})

    async def _metrics(self, request: web.Request) -> web.Response:
        text = (
            "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
            "# TYPE vllm:cache_config_info gauge\n"
            f'vllm:cache_config_info{{block_size="{self.block_size}",cache_dtype="auto",'
            f'enable_prefix_caching="True",num_gpu_blocks="{self.num_gpu_blocks}",'
            f'prefix_caching_hash_algo="{self.hash_algo}"}} 1.0\n'
            "# TYPE process_start_time_seconds gauge\n"
            f"process_start_time_seconds {self.started_at}\n"
        )
        return web.Response(text=text + self.metrics_text)

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": "fake", "object": "model", "max_model_len": self.max_model_len}
        return web.json_response({"object": "list", "data": [model]})

    async def _tokenize(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.seen.append(Seen(request.path, CIMultiDict(request.headers), body))
        try:
            tokens = ids(prompt_words(body))
        except BadRequest as exc:
            return _error(400, str(exc))
        except _WRONG_TYPE as exc:
            return _error(400, f"invalid request: {type(exc).__name__}")
        return web.json_response({"count": len(tokens), "max_model_len": 4096, "tokens": tokens})

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        try:
            return await self._complete_request(request)
        except BadRequest as exc:
            return _error(400, str(exc))
        except _WRONG_TYPE as exc:
            return _error(400, f"invalid request: {type(exc).__name__}")
        except (asyncio.CancelledError, ConnectionResetError):
            # The caller closed the connection: vLLM aborts the request here.
            self._note_abort(request)
            raise

    def _note_abort(self, request: web.Request) -> None:
        self.aborted += 1
        self.aborted_ids.append(request.headers.get("X-Request-Id", ""))
        self._aborts.set()

    async def _complete_request(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.seen.append(Seen(request.path, CIMultiDict(request.headers), body))
        self._count += 1
        self._received.set()
        # Used on receipt: a request that fails or is abandoned later may have read it.
        params = body.get("kv_transfer_params")
        garbage = self.kv_reads is not None and self.kv_reads.use(self, params)
        if self.delay:
            await asyncio.sleep(self.delay)
        reanchor = isinstance(body.get("prompt"), list) and body.get("max_tokens") == 1
        if self.hold_reanchor is not None and reanchor:
            await self.hold_reanchor.wait()
        if self.drop_connections:
            self.drop_connections -= 1
            assert request.transport is not None
            request.transport.close()
            return web.Response(status=500)
        if self.fail_statuses:
            return _error(self.fail_statuses.pop(0))
        if self.fail_with_handle is not None and has_handle(body):
            return _error(self.fail_with_handle, "remote KV load failed")
        params = params or {}
        if self.fail_with_prefill_params is not None and params.get("do_remote_prefill"):
            return _error(self.fail_with_prefill_params, "remote KV load failed")
        prompt = ids(prompt_words(body))
        rid = request.headers.get("X-Request-Id", f"req-{self._count}")
        if self.role == "prefill":
            return web.json_response(self._prefill_answer(body, prompt, rid, garbage))
        return await self._decode_answer(request, body, prompt, rid, garbage)

    def _prefill_answer(
        self, body: dict[str, Any], prompt: list[int], rid: str, garbage: bool = False
    ) -> dict:
        params = None
        if not self.omit_params:
            blocks = -(-len(prompt) // self.block_size)
            where = {
                "remote_block_ids": [list(range(blocks))],
                "remote_request_id": f"{self.name}-{rid}",
                "remote_host": "10.0.0.1",
                "remote_port": 5600,
                "remote_num_tokens": len(prompt),
            }
            params = self._params(True, where, None)
            if self.kv_reads is not None:
                self.kv_reads.issue(self, params, poisoned=garbage)
        return _chat_body(body, "x", [token_id("x")], prompt, False, params, "length")

    def _handle(self, body: dict[str, Any], prompt: list[int], output: list[int], rid: str):
        if self.omit_params or not body.get("kv_transfer_params"):
            return None
        remote = len(prompt) + len(output) - 1
        first = 1000 * self._count
        asked = body["kv_transfer_params"]
        blocks = {
            "remote_block_ids": [list(range(first, first + -(-remote // self.block_size)))],
            "remote_engine_id": self.name,
            "remote_request_id": f"{self.name}-{rid}",
            "remote_host": "10.0.0.2",
            "remote_port": 5601,
            "tp_size": 1,
            "remote_num_tokens": remote,
            "transfer_mode": "pull",
        }
        if asked.get("do_remote_decode") and not asked.get("remote_block_ids"):
            # Prefilled here alone, sent as a prefill-side request: vLLM returns P-style
            # params for this engine's blocks, held for its KV lease.
            return self._params(True, blocks, None)
        return self._params(False, blocks, time.perf_counter() + self.ttl)

    def _params(self, p_node: bool, blocks: dict[str, Any], expiry: float | None) -> dict:
        """``kv_transfer_params`` as ``NixlPullConnectorScheduler.request_finished``
        builds them, field for field and in its order; 0.33 adds
        ``remote_registration_generation`` (NIXL connector version 15)."""
        out = {
            "do_remote_prefill": p_node,
            "do_remote_decode": not p_node,
            "remote_block_ids": blocks["remote_block_ids"],
            "remote_engine_id": self.name,
            "remote_request_id": blocks["remote_request_id"],
            "remote_host": blocks["remote_host"],
            "remote_port": blocks["remote_port"],
            "tp_size": 1,
            "dcp_size": 1,
            "pp_size": 1,
            "remote_num_tokens": blocks["remote_num_tokens"],
            "remote_blocks_expiry_time": expiry,
        }
        if self.streams_handles:
            out["remote_registration_generation"] = self.registration_generation
        out["transfer_mode"] = "pull"
        return out

    @property
    def streams_handles(self) -> bool:
        return Version(self.version).release[:2] >= (0, 33)

    async def _decode_answer(
        self,
        request: web.Request,
        body: dict[str, Any],
        prompt: list[int],
        rid: str,
        garbage: bool = False,
    ) -> web.StreamResponse:
        # Validated before anything is pinned, as vLLM refuses a request it cannot read.
        with_ids = vllm_flag(body, "return_token_ids")
        stream = vllm_flag(body, "stream")
        check_shapes(body)
        words = (GARBAGE if garbage else self.reply).split()
        output = [*ids(words), token_id(EOS)]
        params = self._handle(body, prompt, output, rid)
        if params is not None and self.kv_reads is not None:
            self.kv_reads.issue(self, params, poisoned=garbage)
        self.handles.append(params)
        self.handles_at.append(time.perf_counter())
        if not stream:
            text = " ".join(words)
            if request.transport is None or request.transport.is_closing():
                # The caller left while this (busy) fake computed: vLLM aborts a request
                # whose connection closed before it finished, and keeps no KV for it.
                self._note_abort(request)
            return web.json_response(_chat_body(body, text, output, prompt, with_ids, params))
        return await self._stream(request, body, prompt, words, output, params, with_ids)

    async def _stream(self, request, body, prompt, words, output, params, with_ids):
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await response.prepare(request)
        chat = "messages" in body
        base = {
            "id": "cmpl-1",
            "object": "chat.completion.chunk" if chat else "text_completion",
            "model": body.get("model", "fake"),
        }

        def choice(text: str, tokens: list[int] | None, finish: str | None) -> dict:
            # As vLLM serializes its stream choices (model_dump_json(exclude_unset=True)):
            # the fields its serving code sets are there, null or not.
            c: dict[str, Any] = {"index": 0}
            if chat:
                c["delta"] = {"content": text}
            else:
                c["text"] = text
            c["logprobs"] = None
            c["finish_reason"] = finish
            if finish is not None:
                c["stop_reason"] = None
            c["token_ids"] = tokens if with_ids else None
            return c

        def chunk(choices: list[dict[str, Any]], params: dict | None = None) -> dict:
            out = {**base, "choices": choices}
            if self.streams_handles:
                # 0.33 sets kv_transfer_params on every chunk it builds
                # (ChatCompletionStreamResponse / CompletionStreamResponse): null
                # until the chunk that carries finish_reason, D's handle on that one.
                out["kv_transfer_params"] = params
            return out

        chunks: list[dict[str, Any]] = []
        first = chunk([choice("", None, None)])
        if chat:
            first["choices"][0]["delta"] = {"role": "assistant", "content": ""}
        if with_ids:
            if chat:
                first["prompt_token_ids"] = prompt
            else:
                first["choices"][0]["prompt_token_ids"] = prompt
        chunks.append(first)
        for word, tok in zip(words, output, strict=False):
            chunks.append(chunk([choice(word + " ", [tok], None)]))
        # The chunk with finish_reason carries the handle (0.33; 0.32 never streams it).
        finish_at = len(chunks)
        chunks.append(chunk([choice("", [output[-1]], "stop")], params))
        if (body.get("stream_options") or {}).get("include_usage"):
            # The usage chunk: no choices, serialized with exclude_none (no null fields).
            usage = {
                "prompt_tokens": len(prompt),
                "total_tokens": len(prompt) + len(output),
                "completion_tokens": len(output),
            }
            chunks.append({**base, "choices": [], "usage": usage})
        for i, obj in enumerate(chunks):
            if self.stall and i == len(chunks) - 1:
                await asyncio.sleep(self.stall)
            event = f"data: {json.dumps(obj)}\n\n".encode()
            # Split every event across two writes: the relay must reassemble them.
            half = len(event) // 2
            await response.write(event[:half])
            await response.write(event[half:])
            if self.hold_after_finish is not None and i == finish_at:
                await self.hold_after_finish.wait()
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response


def _error(status: int, message: str = "injected failure") -> web.Response:
    return web.json_response(
        {"error": {"message": message, "type": "InternalServerError", "code": status}},
        status=status,
    )


def _chat_body(
    body: dict[str, Any],
    text: str,
    output: list[int],
    prompt: list[int],
    with_ids: bool,
    params: dict[str, Any] | None,
    finish: str = "stop",
) -> dict[str, Any]:
    if "messages" in body:
        choice: dict[str, Any] = {
            "index": 0,
            "message": {"role": "assistant", "content": text},
            "finish_reason": finish,
            "token_ids": output if with_ids else None,
        }
        top_prompt = prompt if with_ids else None
        kind = "chat.completion"
    else:
        choice = {
            "index": 0,
            "text": text,
            "finish_reason": finish,
            "prompt_token_ids": prompt if with_ids else None,
            "token_ids": output if with_ids else None,
        }
        top_prompt = None
        kind = "text_completion"
    out = {
        "id": "cmpl-1",
        "object": kind,
        "model": body.get("model", "fake"),
        "choices": [choice],
        "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(output)},
        "kv_transfer_params": params,
    }
    if kind == "chat.completion":
        out["prompt_token_ids"] = top_prompt
    return out


class FakeClock:
    """The handle store's clock, starting at the real perf_counter (the fake D stamps
    expiry times with it, as vLLM does) and advanced by tests."""

    def __init__(self) -> None:
        self.offset = 0.0

    def __call__(self) -> float:
        return time.perf_counter() + self.offset

    def advance(self, seconds: float) -> None:
        self.offset += seconds
