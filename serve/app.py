"""The OpenAI-compatible HTTP API over one engine: completions, chat, models, health, metrics.

FastAPI on uvicorn: the standard Python ASGI stack (what vLLM's and SGLang's OpenAI servers
use), so SSE streaming, client-disconnect detection and graceful shutdown come from well-tested
code, and the app can be driven in-process or over real sockets the same way. The model never
runs on the event loop: the engine's worker thread owns it, and the loop only parses, admits and
relays events.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from selfspec.adapters.errors import AdapterError
from selfspec.adapters.store import AdapterStore
from selfspec.drafting.context import ContextDrafts
from selfspec.generation import GenerationConfig, GenerationResult, SpeculativeGenerator
from selfspec.heads import load_heads
from selfspec.heads.delta import DELTA_DIR, DeltaBank, DeltaError, load_delta, save_delta
from selfspec.logprobs import TokenLogprob
from selfspec.prefix_cache import PrefixCache
from selfspec.sampling import SamplingParams
from selfspec.serve.drift import DriftConfig, DriftMonitor
from selfspec.serve.engine import Engine, Event, RequestHandle
from selfspec.serve.errors import APIError, bad_request, not_found
from selfspec.serve.guard import AccessPolicy, Guard
from selfspec.serve.logprobs_format import TokenTexts, chat_logprobs, completion_logprobs
from selfspec.serve.metrics import ServerMetrics
from selfspec.serve.protocol import ParsedRequest, parse_request
from selfspec.serve.recalibration import Outcome, RecalibrationPolicy, ServedRecalibrator
from selfspec.speculation_gate import SpeculationGate
from selfspec.stats import GenerationStats
from selfspec.target import apply_chat_template
from selfspec.tree import TreeSpec

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
"""How often a request with no new tokens checks whether its client is still there."""
COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


@dataclass
class ServerState:
    """What the app serves: one generator on the base model, its adapter store, the engine."""

    generator: SpeculativeGenerator
    tokenizer: Any
    model_name: str
    """The base model's name: `model` equal to it selects no adapter."""
    store: AdapterStore | None = None
    tree: TreeSpec | None = None
    """Every speculative request's tree; None: the generator's default (adaptive with a curve)."""
    max_running: int = 16
    max_queue: int = 64
    max_queue_per_adapter: int | None = None
    """Waiting places one adapter may hold; None: all but a quarter of max_queue."""
    batch_verify: bool = True
    context_drafts: ContextDrafts | None = ContextDrafts()
    """Every speculative request also drafts chains copied from its own context
    (``selfspec.drafting.context``); None: the heads' drafts alone."""
    speculation_gate: bool = True
    """Rounds speculate only where that commits more tokens per second (``SpeculationGate``);
    False: every round of a speculating request drafts."""
    prefill_chunk: int | None = None
    """Prompt tokens the new requests' prefills may run per engine round (``Engine``); None:
    every new prompt whole in its first round."""
    drain_timeout: float = 30.0
    enable_lora_management: bool = False
    prefix_cache: PrefixCache | None = None
    """Prompt prefixes' KV reused across requests, per adapter; used only where it is exact
    (the target on the row-invariant kernels), else turned off with a warning."""
    access: AccessPolicy = field(default_factory=AccessPolicy)
    """API key, allowed hosts, body limit (see ``serve.guard``)."""
    drift: DriftConfig = field(default_factory=DriftConfig)
    """When an adapter counts as drifting from the base's draft acceptance (``serve.drift``)."""
    recalibration: RecalibrationPolicy | None = None
    """Opt-in: recalibrate drifting adapters' draft deltas from their served outputs, in the
    background (``serve.recalibration``); needs ``heads_dir``."""
    heads_dir: Path | None = None
    """Where the shared heads were loaded from (the recalibration process reads them)."""
    target_model: str | None = None
    """The target as a process loads it (a local dir or .gguf; None: the embedded default)."""
    request_timeout: float | None = None
    """Seconds a request may take from admission to its last token; then it is cancelled and
    answered 504 (a stream ends with an error event). None: no deadline."""
    created: int = field(default_factory=lambda: int(time.time()))
    metrics: ServerMetrics = field(default_factory=ServerMetrics)
    engine: Engine = field(init=False)
    texts: TokenTexts = field(init=False)
    """Token id -> text, for log-probabilities."""
    served: set[str] = field(init=False)
    """Adapters requests may name: the store's at start, plus runtime loads, minus unloads."""
    lock: threading.Lock = field(default_factory=threading.Lock)

    adapter_heads: bool = True
    """Requests on an adapter that carries recalibrated heads (``<adapter>/heads/``, see
    ``selfspec recalibrate``) speculate with those; False: the shared heads for all."""
    _generators: dict[str, SpeculativeGenerator] = field(default_factory=dict, init=False)
    delta_bank: DeltaBank | None = field(default=None, init=False)
    """Adapters' draft deltas over the shared heads (``selfspec.heads.delta``), loaded on each
    adapter's first request."""
    recalibrator: ServedRecalibrator | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.texts = TokenTexts(self.tokenizer)
        if self.prefix_cache is not None and not self.generator.prefix_cache_exact:
            logger.warning(
                "prefix cache off: reusing cached prefixes is exact only on the row-invariant "
                "kernels, which this target does not run on"
            )
            self.prefix_cache = None
        self.generator.prefix_cache = self.prefix_cache
        if self.prefix_cache is not None:
            self.metrics.watch_prefix_cache(self.prefix_cache)
        self.metrics.watch_drift(DriftMonitor(self.model_name, self.drift))
        self.engine = Engine(
            self.store,
            self.metrics,
            self.max_running,
            self.max_queue,
            self.batch_verify,
            self.max_queue_per_adapter,
            SpeculationGate() if self.speculation_gate else None,
            self.prefill_chunk,
        )
        self.served = set(self.store.names()) if self.store is not None else set()
        if self.recalibration is not None:
            self._start_recalibrator(self.recalibration)

    def _start_recalibrator(self, policy: RecalibrationPolicy) -> None:
        if self.store is None or not self.can_speculate or self.heads_dir is None:
            raise ValueError(
                "background recalibration needs adapters, draft heads and their directory"
            )
        self.recalibrator = ServedRecalibrator(
            policy,
            self.heads_dir,
            self.target_model,
            self.metrics.drift,
            install=self.install_delta,
            current_delta=self._delta_on_disk,
            on_outcome=self._count_outcome,
        )
        recalibrator = self.recalibrator

        def collect(job, result: GenerationResult) -> None:
            recalibrator.collect(job.adapter, job.stream.prompt_ids, result)

        self.engine.on_finished = collect

    def records_features(self, adapter: str | None, generator: SpeculativeGenerator) -> bool:
        """Whether a speculating request on ``adapter`` drafting with ``generator`` should
        record its features for background recalibration."""
        return (
            self.recalibrator is not None
            and generator is self.generator  # the shared heads (not the adapter's own copy)
            and self.recalibrator.wants(adapter)
        )

    def install_delta(self, adapter: str, directory: Path) -> None:
        """Swap ``directory``'s draft delta in for ``adapter`` between two engine rounds (and,
        with the policy's ``save``, write it to ``<adapter>/heads-delta/``). Raises DeltaError
        for a delta these heads cannot use, KeyError for an adapter no longer served."""
        with self.lock:
            if adapter not in self.served:
                raise KeyError(f"adapter {adapter!r} is no longer served")
            known = self.delta_bank.hash if self.delta_bank is not None else None
        delta = load_delta(directory, self.generator.heads, known)

        def swap() -> None:  # on the engine's worker: no round is drafting
            with self.lock:
                if adapter not in self.served:
                    return
                if self.delta_bank is None:
                    self.delta_bank = DeltaBank(self.generator.heads)
                self.delta_bank.add(adapter, delta)
            self.metrics.drift.forget(adapter)  # its averages now measure the new delta

        self.engine.between_rounds(swap)
        if self.recalibration is not None and self.recalibration.save:
            destination = self.store.info(adapter).path / DELTA_DIR
            try:  # swapped in either way; a read-only adapter directory only loses the copy
                save_delta(delta, destination, {"source": "served"})
            except OSError as error:
                logger.warning(
                    "could not save %r's new draft delta to %s: %s", adapter, destination, error
                )

    def _delta_on_disk(self, adapter: str) -> Path | None:
        """``<adapter>/heads-delta/`` when the adapter drafts with it now, else None."""
        bank = self.delta_bank
        if bank is None or adapter not in bank:
            return None
        try:
            directory = self.store.info(adapter).path / DELTA_DIR
        except AdapterError:  # unloaded meanwhile
            return None
        return directory if directory.is_dir() else None

    def _count_outcome(self, outcome: Outcome) -> None:
        self.metrics.recalibrations.labels(outcome.adapter, outcome.outcome).inc()

    @property
    def can_speculate(self) -> bool:
        return self.generator.drafter is not None

    def generator_for(self, adapter: str | None) -> SpeculativeGenerator:
        """The shared generator, or one over the same target with the adapter's own heads
        (loaded once, on its first request). Bad heads: 400 naming the adapter."""
        if adapter is None or self.store is None or not self.adapter_heads:
            return self.generator
        if not self.can_speculate:
            return self.generator
        heads_path = self.store.info(adapter).heads_path
        if heads_path is None:
            self._load_delta(adapter)  # the shared heads, with the adapter's delta if it has one
            return self.generator
        with self.lock:
            own = self._generators.get(adapter)
            if own is None:
                try:
                    heads = load_heads(heads_path, self.store.base_model)
                except (ValueError, OSError) as error:  # malformed, unreadable, another base
                    raise bad_request(
                        f"adapter {adapter!r} carries heads that cannot be used: {error}", "model"
                    ) from error
                own = SpeculativeGenerator(
                    self.store.base_model, heads, self.tokenizer, self.generator.cost_curve
                )
                own.prefix_cache = self.prefix_cache
                own.corpus = self.generator.corpus
                self._generators[adapter] = own
            return own

    def _load_delta(self, adapter: str) -> None:
        """Register ``<adapter>/heads-delta/`` in the shared heads' delta bank (once). A bad
        delta: 400 naming the adapter."""
        directory = self.store.info(adapter).path / DELTA_DIR
        if not directory.is_dir():
            return
        with self.lock:
            if self.delta_bank is not None and adapter in self.delta_bank:
                return
            try:
                bank = self.delta_bank  # its hash of the shared heads saves hashing them again
                known = bank.hash if bank is not None else None
                delta = load_delta(directory, self.generator.heads, known)
            except DeltaError as error:
                raise bad_request(
                    f"adapter {adapter!r} carries a draft delta that cannot be used: {error}",
                    "model",
                ) from error
            if self.delta_bank is None:  # wraps the shared heads' layers; same output unless active
                self.delta_bank = DeltaBank(self.generator.heads)
            self.delta_bank.add(adapter, delta)

    def scope_for(self, adapter: str | None) -> Callable[[], contextlib.AbstractContextManager]:
        """A request's step scope: its adapter active in the target and, when it carries a
        draft delta, that delta in the heads."""
        store_scope = self.store.scope(adapter)
        bank = self.delta_bank
        if bank is None or adapter not in bank:
            return store_scope

        @contextlib.contextmanager
        def with_delta() -> Iterator[None]:
            with store_scope(), bank.active(adapter):
                yield

        return with_delta


def create_app(state: ServerState) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        yield
        await run_in_threadpool(state.engine.shutdown, state.drain_timeout)
        if state.recalibrator is not None:
            await run_in_threadpool(state.recalibrator.close)

    app = FastAPI(title="selfspec", lifespan=lifespan)
    app.state.selfspec = state
    app.add_middleware(Guard, policy=state.access)

    @app.exception_handler(APIError)
    async def _api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        body = APIError(error.status_code, str(error.detail), type_=kind).body()
        return JSONResponse(body, status_code=error.status_code)

    @app.get("/health")
    async def health() -> JSONResponse:
        counts = state.engine.counts()
        if not state.engine.serving:
            body = APIError(503, "the engine is not serving", "service_unavailable").body()
            return JSONResponse({**body, **counts}, status_code=503)
        return JSONResponse({"status": "ok", **counts})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models() -> JSONResponse:
        data = [_model_card(state.model_name, state.created, None, None)]
        with state.lock:
            names = sorted(state.served)
        for name in names:
            root = state.store.info(name).display_path  # never a resolved absolute path
            data.append(_model_card(name, state.created, state.model_name, root))
        return JSONResponse({"object": "list", "data": data})

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        parsed = parse_request(await _json_body(request), chat=False)
        return await _serve(state, request, parsed, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        parsed = parse_request(await _json_body(request), chat=True)
        return await _serve(state, request, parsed, chat=True)

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(request: Request) -> JSONResponse:
        body = await _json_body(request)
        _check_management(state)
        name, path = _str_field(body, "lora_name"), _str_field(body, "lora_path")
        if name == state.model_name:
            raise bad_request(
                f"{name!r} is the base model's name: an adapter under it could not be reached",
                "lora_name",
            )
        if state.store.root is None:
            raise bad_request(
                "runtime loading needs an adapters root (--adapters-root); adapters are only "
                "loaded from inside it",
                "lora_path",
            )
        with state.lock:
            if name in state.served:
                raise bad_request(f"adapter {name!r} is already loaded", "lora_name")
        await run_in_threadpool(_load_adapter, state, name, path)
        return JSONResponse({"status": "ok", "adapter": name, "parent": state.model_name})

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(request: Request) -> JSONResponse:
        """Drain, then unload: requests naming the adapter get 404 from now on, those running
        finish (up to --drain-timeout), then its weights go. ``"wait": false``: 409 at once
        while any request runs on it."""
        body = await _json_body(request)
        _check_management(state)
        name = _str_field(body, "lora_name")
        wait = body.get("wait", True)
        if not isinstance(wait, bool):
            raise bad_request("'wait' must be true or false", "wait")
        with state.lock:
            if name not in state.served:
                raise not_found(f"adapter {name!r} is not loaded", "lora_name")
        busy = state.engine.in_flight(name)
        if busy and not wait:
            raise _adapter_busy(name, busy, "")
        await run_in_threadpool(_unload_adapter, state, name)
        return JSONResponse({"status": "ok", "adapter": name})

    return app


# -- requests ---------------------------------------------------------------------------------


async def _serve(
    state: ServerState, request: Request, parsed: ParsedRequest, chat: bool
) -> Response:
    adapter = _adapter_for(state, parsed.model)
    # Off the event loop: a long prompt takes a while to tokenize, and /health must answer.
    prompt_ids = await run_in_threadpool(_prompt_ids, state, parsed)
    speculate = state.can_speculate if parsed.speculation is None else parsed.speculation
    if speculate and not state.can_speculate:
        raise bad_request(
            "this server has no draft heads: speculation is unavailable", "speculation"
        )
    # Off the event loop: an adapter's own heads are read from disk on its first request.
    generator = (
        await run_in_threadpool(state.generator_for, adapter) if speculate else state.generator
    )
    sampling = SamplingParams(
        temperature=parsed.temperature, top_k=parsed.top_k, top_p=parsed.top_p
    )
    probe = GenerationConfig(
        max_new_tokens=1, sampling=sampling, speculate=speculate, tree=state.tree
    )
    depth = generator.tree_for(probe).depth if speculate else 0
    limit = generator.context_limit
    max_tokens = parsed.max_tokens
    field_name = "messages" if chat else "prompt"
    if max_tokens is None:
        if chat:
            max_tokens = (limit - len(prompt_ids) - depth) if limit is not None else 256
        else:
            max_tokens = COMPLETIONS_DEFAULT_MAX_TOKENS
    else:
        field_name = "max_tokens"
    if limit is not None and (max_tokens < 1 or len(prompt_ids) + max_tokens + depth > limit):
        spec_part = f" + {depth} (speculation tree depth)" if depth else ""
        raise bad_request(
            f"this model's maximum context length is {limit} tokens; the request needs "
            f"{len(prompt_ids)} (prompt) + {max_tokens} (max_tokens){spec_part} = "
            f"{len(prompt_ids) + max_tokens + depth}; shorten the prompt or lower max_tokens",
            field_name,
        )
    capacity = state.max_running + state.max_queue
    if parsed.n > capacity:
        # Could never be admitted (all choices are admitted together): not worth a retry.
        raise bad_request(
            f"'n' = {parsed.n} choices exceeds this server's capacity of {capacity} concurrent "
            f"requests (max_running {state.max_running} + max_queue {state.max_queue})",
            "n",
        )
    config = GenerationConfig(
        max_new_tokens=max_tokens,
        sampling=sampling,
        seed=parsed.seed,
        stop_strings=parsed.stop,
        stop_token_ids=() if parsed.ignore_eos else None,
        speculate=speculate,
        tree=state.tree,
        context_drafts=state.context_drafts,
        logprobs=parsed.logprobs,
        prompt_logprobs=parsed.echo and parsed.logprobs is not None,
        prefix_namespace=(adapter or state.model_name) if state.prefix_cache is not None else None,
        record_features=speculate and state.records_features(adapter, generator),
    )
    streams = []
    for index in range(parsed.n):
        # Choice i: seed + i, so a seeded request repeats exactly and its choices differ.
        seed = None if parsed.seed is None else parsed.seed + index
        scope = state.scope_for(adapter) if state.store is not None else None
        try:
            streams.append(generator.stream(prompt_ids, replace(config, seed=seed), scope))
        except ValueError as error:
            raise bad_request(str(error)) from error
    label = adapter or state.model_name
    handle = state.engine.submit(streams, adapter, label, speculate, asyncio.get_running_loop())
    reply = _Reply(parsed, chat, prompt_ids, speculate, handle, state.request_timeout, state.texts)
    if parsed.stream:
        return StreamingResponse(
            reply.sse(request),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    results = await reply.wait(request)
    return JSONResponse(reply.full_body(results))


class _Reply:
    """Turns a request's engine events into an OpenAI response, whole or as SSE chunks.

    With `n` > 1 the choices' events interleave as the engine runs them; each event carries its
    choice's index. `usage.completion_tokens` and the `selfspec` stats cover all choices."""

    def __init__(
        self,
        parsed: ParsedRequest,
        chat: bool,
        prompt_ids: list[int],
        speculate: bool,
        handle: RequestHandle,
        timeout: float | None,
        texts: TokenTexts,
    ) -> None:
        self.parsed = parsed
        self.timeout = timeout
        self.chat = chat
        self.prompt_ids = prompt_ids
        self.prompt_tokens = len(prompt_ids)
        self.texts = texts
        self.echo_text = ""
        if parsed.echo:
            prompt = parsed.prompt
            self.echo_text = prompt if isinstance(prompt, str) else texts.text_of(prompt)
        self.speculate = speculate
        self.handle = handle
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.object = "chat.completion" if chat else "text_completion"

    async def _events(self, request: Request, poll: bool) -> AsyncIterator[Event]:
        """The events of all choices, until every choice is done or one fails or is cancelled;
        then (or when the client goes away) cancels whatever is still in flight.

        `poll`: check the connection every `DISCONNECT_POLL_S` (a whole response). A streamed
        response leaves that to Starlette, which stops the stream when a send fails or the client
        disconnects; the finally below then cancels the request."""
        loop = asyncio.get_running_loop()
        checked = loop.time()
        deadline = None if self.timeout is None else checked + self.timeout
        left = self.parsed.n
        try:
            while left:
                wait = DISCONNECT_POLL_S
                if deadline is not None:
                    if loop.time() >= deadline:
                        yield Event("error", error=_timed_out(self.timeout))
                        return  # the finally below cancels the request
                    wait = min(wait, deadline - loop.time())
                event = await self.handle.next_event(wait)
                if poll and loop.time() - checked >= DISCONNECT_POLL_S:
                    checked = loop.time()
                    if await request.is_disconnected():
                        return  # the finally below cancels the request
                if event is None:
                    continue
                yield event
                if event.kind == "done":
                    left -= 1
                elif event.kind != "delta":
                    return  # one choice failed: the others are cancelled below
        finally:
            # Also reached when the server stops streaming to a client that went away.
            self.handle.cancel()

    async def wait(self, request: Request) -> list[GenerationResult]:
        """Every choice's result, in choice order."""
        results: dict[int, GenerationResult] = {}
        failure: APIError | None = None
        async for event in self._events(request, poll=True):
            if event.kind == "done":
                results[event.index] = event.result
            elif event.kind == "error":
                failure = event.error
            elif event.kind == "cancelled":
                failure = _cancelled()
        if failure is not None:
            raise failure
        if len(results) < self.parsed.n:
            raise APIError(499, "client disconnected", "client_closed_request")
        return [results[index] for index in range(self.parsed.n)]

    async def sse(self, request: Request) -> AsyncIterator[str]:
        if self.chat:
            for index in range(self.parsed.n):
                yield _sse(self._chunk({"role": "assistant", "content": ""}, None, index))
        results: dict[int, GenerationResult] = {}
        offsets: dict[int, int] = {}  # completions: characters of each choice's text so far
        async for event in self._events(request, poll=False):
            index = event.index
            if event.kind == "delta" and self.parsed.echo and index not in offsets:
                scored = event.output.prompt_logprobs  # the prompt first, scored when asked
                logprobs = None if scored is None else self._logprobs(scored, self.prompt_ids)
                yield _sse(self._chunk(self.echo_text, None, index, logprobs))
                offsets[index] = len(self.echo_text)
            wanted = self.parsed.logprobs is not None and event.kind == "delta"
            if event.kind == "delta" and (event.output.text or (wanted and event.output.token_ids)):
                output, offset = event.output, offsets.get(index, 0)
                delta = {"content": output.text} if self.chat else output.text
                logprobs = (
                    self._logprobs(output.logprobs, output.token_ids, offset) if wanted else None
                )
                yield _sse(self._chunk(delta, None, index, logprobs))
                offsets[index] = offset + len(output.text)
            elif event.kind == "done":
                results[event.index] = result = event.result
                final = self._chunk(
                    {} if self.chat else "", result.finish_reason.value, event.index
                )
                if len(results) == self.parsed.n:  # the last choice to finish
                    done = [results[index] for index in range(self.parsed.n)]
                    final["selfspec"] = self._stats(done)
                    yield _sse(final)
                    if self.parsed.include_usage:
                        usage = self._base()
                        usage.update(choices=[], usage=self._usage(done))
                        yield _sse(usage)
                else:
                    yield _sse(final)
            elif event.kind in ("error", "cancelled"):
                yield _sse((event.error or _cancelled()).body())
        yield "data: [DONE]\n\n"

    def _base(self) -> dict[str, Any]:
        chunk_object = "chat.completion.chunk" if self.chat else "text_completion"
        return {
            "id": self.id,
            "object": chunk_object,
            "created": self.created,
            "model": self.parsed.model,
        }

    def _logprobs(
        self, items: list[TokenLogprob | None] | None, token_ids: list[int], offset: int = 0
    ) -> dict[str, Any] | None:
        """The log-probabilities of ``token_ids`` in this endpoint's shape."""
        if items is None:
            return None
        if self.chat:
            return chat_logprobs(self.texts, [item for item in items if item is not None])
        return completion_logprobs(self.texts, items, token_ids, offset)

    def _chunk(
        self,
        delta: Any,
        finish_reason: str | None,
        index: int,
        logprobs: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index}
        if self.chat:
            choice.update(delta=delta, logprobs=logprobs, finish_reason=finish_reason)
        else:
            choice.update(text=delta, logprobs=logprobs, finish_reason=finish_reason)
        chunk = self._base()
        chunk["choices"] = [choice]
        if self.parsed.include_usage:
            chunk["usage"] = None
        return chunk

    def full_body(self, results: list[GenerationResult]) -> dict[str, Any]:
        choices = []
        for index, result in enumerate(results):
            choice: dict[str, Any] = {"index": index}
            if self.chat:
                choice["message"] = {"role": "assistant", "content": result.text}
            else:
                choice.update(text=self.echo_text + result.text)
            choice.update(logprobs=self._result_logprobs(result))
            choice.update(finish_reason=result.finish_reason.value)
            choices.append(choice)
        return {
            "id": self.id,
            "object": self.object,
            "created": self.created,
            "model": self.parsed.model,
            "choices": choices,
            "usage": self._usage(results),
            "selfspec": self._stats(results),
        }

    def _result_logprobs(self, result: GenerationResult) -> dict[str, Any] | None:
        if self.parsed.logprobs is None:
            return None
        items: list[TokenLogprob | None] = list(result.logprobs or [])
        token_ids = list(result.token_ids)
        if self.parsed.echo:  # the prompt's scores first (its first token has none)
            items = [*(result.prompt_logprobs or [None] * len(self.prompt_ids)), *items]
            token_ids = [*self.prompt_ids, *token_ids]
        return self._logprobs(items, token_ids)

    def _usage(self, results: list[GenerationResult]) -> dict[str, int]:
        """The prompt counted once (as OpenAI does), completion tokens summed over choices."""
        completion = sum(len(result.token_ids) for result in results)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": completion,
            "total_tokens": self.prompt_tokens + completion,
        }

    def _stats(self, results: list[GenerationResult]) -> dict[str, Any]:
        """Speculation stats of the request, all choices pooled: their decode steps taken
        together, so τ = committed tokens / target forwards over all choices (bonus included;
        1.0 without speculation), counts and seconds summed, acceptance at depth d over every
        step that reached d. `queue_seconds`: the longest wait of a choice."""
        steps = [step for result in results for step in result.stats.steps]
        pooled = GenerationStats(steps=steps)
        return {
            "speculation": self.speculate,
            "tau": round(pooled.tau, 4),
            "target_forwards": pooled.target_forwards,
            "draft_tokens": sum(s.tree_size - 1 for s in steps),
            "accepted_tokens": sum(s.accepted for s in steps),
            "acceptance_by_depth": [round(r, 4) for r in pooled.acceptance_by_depth()],
            "queue_seconds": round(self.handle.queue_seconds, 4),
            "prefill_seconds": round(sum(r.stats.prefill_seconds for r in results), 4),
            "decode_seconds": round(sum(r.stats.decode_seconds for r in results), 4),
        }


def _timed_out(timeout: float | None) -> APIError:
    return APIError(
        504,
        f"the request did not finish within this server's limit of {timeout:g} s "
        "(--request-timeout); it was cancelled",
        "timeout_error",
        code="request_timeout",
    )


def _cancelled() -> APIError:
    return APIError(503, "the request was cancelled (server shutting down)", "service_unavailable")


# -- helpers ----------------------------------------------------------------------------------


async def _json_body(request: Request) -> Any:
    """The parsed body; 400 for anything json.loads refuses or Python cannot represent: bad
    syntax or encoding, nesting deeper than the parser's recursion, integers of more than 4,300
    digits, lone surrogates (text no tokenizer can encode)."""
    raw = await request.body()
    try:
        body = json.loads(raw)
    except RecursionError as error:
        raise bad_request("the request body is nested too deeply") from error
    except (ValueError, UnicodeDecodeError) as error:  # JSONDecodeError is a ValueError
        raise bad_request(f"the request body is not valid JSON: {error}") from error
    try:
        json.dumps(body, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError as error:
        raise bad_request(
            "the request body holds a string that is not valid Unicode (a lone surrogate "
            f"escape such as \\ud800): {error.reason}"
        ) from error
    return body


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload)}\n\n"


def _model_card(name: str, created: int, parent: str | None, root: str | None) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "selfspec",
        "root": root or name,
        "parent": parent,
    }


def _adapter_for(state: ServerState, model: str) -> str | None:
    if model == state.model_name:
        return None
    with state.lock:
        if model in state.served:
            return model
        served = sorted(state.served)
    raise not_found(
        f"the model {model!r} does not exist: it is neither the base model "
        f"{state.model_name!r} nor a served adapter ({', '.join(served) or 'none'})",
        "model",
    )


def _prompt_ids(state: ServerState, parsed: ParsedRequest) -> list[int]:
    tokenizer = state.tokenizer
    if parsed.messages is not None:
        try:
            return apply_chat_template(tokenizer, parsed.messages)
        except ValueError as error:
            raise bad_request(str(error), "messages") from error
    if isinstance(parsed.prompt, str):
        return list(tokenizer.encode(parsed.prompt))
    vocab = state.generator.target.vocab_size
    bad = [t for t in parsed.prompt if not 0 <= t < vocab]
    if bad:
        raise bad_request(f"'prompt' token ids must be in [0, {vocab}), got {bad[:5]}", "prompt")
    return list(parsed.prompt)


def _check_management(state: ServerState) -> None:
    if not state.enable_lora_management:
        raise APIError(
            403,
            "runtime adapter management is off; start the server with "
            "--enable-lora-management to allow it",
            "permission_error",
        )
    if state.store is None:
        raise bad_request("this server has no adapter store")


def _str_field(body: Any, name: str) -> str:
    if not isinstance(body, dict):
        raise bad_request("the request body must be a JSON object")
    value = body.get(name)
    if not isinstance(value, str) or not value:
        raise bad_request(f"'{name}' must be a non-empty string", name)
    return value


def _load_adapter(state: ServerState, name: str, path: str) -> None:
    """Validate and load `path` (inside the root) as `name`; the store is unchanged on error."""
    try:
        state.store.register(name, path)
        state.store.load(name)
    except AdapterError as error:
        raise bad_request(f"cannot load adapter {name!r}: {error}", "lora_path") from error
    with state.lock:
        state.served.add(name)


def _unload_adapter(state: ServerState, name: str) -> None:
    with state.lock:
        state.served.discard(name)  # no new request may name it from now on
        state._generators.pop(name, None)  # running requests keep theirs; a reload reads anew
    if not state.engine.wait_for_adapter(name, state.drain_timeout):
        with state.lock:
            state.served.add(name)
        busy = state.engine.in_flight(name)
        raise _adapter_busy(name, busy, f" after waiting {state.drain_timeout:g} s")
    try:
        state.store.forget(name)  # the name is free: a later load may give it other weights
    except AdapterError as error:
        with state.lock:
            state.served.add(name)
        raise bad_request(f"cannot unload adapter {name!r}: {error}", "lora_name") from error
    state.metrics.forget(name)
    if state.recalibrator is not None:
        state.recalibrator.forget(name)
    if state.delta_bank is not None:
        state.delta_bank.remove(name)
    if state.prefix_cache is not None:
        state.prefix_cache.drop(name)  # a later load under this name may be other weights


def _adapter_busy(name: str, busy: int, waited: str) -> APIError:
    return APIError(
        409,
        f"adapter {name!r} still has {busy} request(s) in flight{waited}; not unloaded",
        param="lora_name",
        code="adapter_busy",
    )
