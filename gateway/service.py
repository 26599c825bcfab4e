"""The gateway's request path: pick an engine for the model, run the request, account for it."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any, AsyncIterator, Callable, NamedTuple, Sequence

import httpx
import msgspec

from engines.seam import (EmbeddingEngine, Engine, EngineError, HintedEngine, PrioritizedEngine, ResponsesEngine,
                          ResponsesRoute, Route)
from engines.seam.connect import connect, has_capability
from wire.openai import COMPLETIONS_DEFAULT_MAX_TOKENS, ChatCompletionRequest, CompletionRequest, prompt_count, served_tier
from wire.sse import SSE_DONE, sse_event
from engines.seam.upstream import upstream_class
from gateway.attempts import Attempts, retryable
from gateway.config import GatewayConfig
from gateway.engine_events import EngineEvents
from gateway.domain_errors import Conflict, Invalid, model_not_found
from gateway.errors import engine_error_body, error_payload
from gateway.metrics import GatewayMetrics, RouteMetrics, carries_token
from gateway.outcomes import Outcomes, Reported, read_usage
from gateway.prompt_prefix import prompt_prefix
from gateway.registry import EngineConflict, EngineRecord, EngineRegistry, endpoints_of
from gateway.scheduler import THROUGHPUT_LEVEL, Placement, Scheduler, Work
from wire.sampling import affinity_key, tier_criteria

OpenAIRequest = ChatCompletionRequest | CompletionRequest
REQUEST_SCHEMAS: dict[str, type[OpenAIRequest]] = {"chat/completions": ChatCompletionRequest, "completions": CompletionRequest}
ENGINE_HEADER = "x-parrot-engine"  # on every proxied response: the engine it came from (its id in GET /v1/engines)
_HOLD_POLL_S = 0.02  # how often held throughput work looks again (admission)
_FRESH_S = 0.25  # how old an engine's stats may be for admission (older: asked of the engine then)


def placement_of(body: dict[str, Any]) -> Placement:
    """A plain request's placement from its OpenAI fields: ``service_tier`` "flex" is throughput work (any
    other tier latency work, as a plain request is), ``prompt_cache_key`` its affinity key."""
    return Placement(latency=tier_criteria(body) != "throughput", affinity=affinity_key(body))


def hints_of(placement: Placement) -> dict[str, Any] | None:
    """A plain request's scheduling hints for an engine that takes them (the builtin one orders and batches by
    criteria): throughput work says so; latency work is what a plain request is to it anyway."""
    return None if placement.latency else {"criteria": "throughput"}


async def events_with_service_tier(events: AsyncIterator[bytes], body: dict[str, Any]) -> AsyncIterator[bytes]:
    """A stream's SSE events, each chunk naming the request's ``service_tier`` as OpenAI's do (events that name
    one already, and error objects, as they are)."""
    tier = b'data: {"service_tier":' + msgspec.json.encode(served_tier(body["service_tier"])) + b","
    async with contextlib.aclosing(events):  # closed with this one: the engine's stream and its accounting
        async for batch in events:
            if b'"service_tier"' not in batch and b'data: {"error"' not in batch:
                batch = batch.replace(b"data: {", tier)
            yield batch


def with_service_tier(answer: bytes, body: dict[str, Any]) -> bytes:
    """An answer to a request that named a ``service_tier`` echoes it, as OpenAI's do (an engine's own member
    of that name stays); others are returned as they are, not read."""
    tier = body.get("service_tier")
    if not isinstance(tier, str) or not answer.startswith(b"{") or b'"service_tier"' in answer:
        return answer
    rest = answer[1:].lstrip()
    return b'{"service_tier":' + msgspec.json.encode(served_tier(tier)) + (b"," if not rest.startswith(b"}") else b"") + rest


class Answer(NamedTuple):
    body: bytes
    engine_id: str  # where it ran (the x-parrot-engine header)
    reported: Reported | None = None  # the body as ``create`` read it for the metrics (None: unreadable)
    dispatched: float = 0.0  # when it was sent to the engine that answered it (Unix seconds)


class OpenedStream(msgspec.Struct):
    record: EngineRecord
    first: bytes | None
    rest: AsyncIterator[bytes]
    started: float
    measured: RouteMetrics  # the model's metrics on the engine it runs on
    latency: bool = False  # latency-critical work, counted in its engine's latency_in_flight while it streams
    dispatched: float = 0.0  # when it was sent to its engine (Unix seconds)


class Gateway:
    def __init__(self, config: GatewayConfig, registry: EngineRegistry, metrics: GatewayMetrics,
                 client: httpx.AsyncClient, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self.registry = registry
        self.scheduler = Scheduler(config.scheduler)
        registry.on_removed(self.scheduler.forget)
        self.events = EngineEvents(config.kv_events)  # engines' KV-cache events, where configured
        self.scheduler.exact = self.events.exact
        self.metrics = metrics
        self.outcomes = Outcomes(metrics)
        self.client = client
        self.transport = transport  # the client's, for the engines' hot path

    def add_upstreams(self) -> None:
        for i, upstream in enumerate(self.config.upstreams):
            name = upstream.name or f"upstream-{i}"
            options: dict[str, Any] = dict(upstream_model=upstream.served_model(), api_key_env=upstream.api_key_env,
                                           transport=self.transport, embeds=upstream.embeddings)
            prioritized = upstream.priority_scheduling != "off"  # vLLM / SGLang: criteria become their `priority`
            if prioritized:
                options["lower_first"] = upstream.priority_scheduling == "lower_first"
            engine_class = upstream_class(prioritized=prioritized, prefill=upstream.prefill_ahead,
                                          responses=upstream.responses)
            engine = engine_class(name, upstream.base_url, self.client, **options)
            record = self.registry.add(engine, [upstream.model], url=upstream.base_url)
            if upstream.kv_events:
                self.events.add(record, upstream)

    async def register_remote(self, name: str, url: str, models: list[str], capabilities: list[str],
                              secret: str) -> EngineRecord:
        """An engine process announcing itself with the engine secret, which the gateway then presents
        to it on every request (a builtin engine started with a secret requires it). A URL a live
        engine holds is refused: an engine restarted before its old record expired retries."""
        url = url.rstrip("/")
        try:
            endpoints = await endpoints_of(url)
        except ValueError as exc:
            raise Invalid(str(exc), param="url") from exc
        engine = connect(name, url, self.client, capabilities=capabilities, api_key=secret, transport=self.transport)
        try:
            return self.registry.register(engine, models, url=url, endpoints=endpoints)
        except EngineConflict as exc:
            raise Conflict(str(exc), param="url", code="engine_url_taken") from exc
        except ValueError as exc:
            raise Invalid(str(exc), param="url") from exc

    # ------------------------------------------------------------ engines

    def serves_responses(self, model: str) -> bool:
        """Whether ``model``'s Responses requests are passed through: an engine of it speaks that API itself
        (then only such engines get them)."""
        return any(_speaks_responses(r) for r in self.registry.records() if model in r.models)

    def engines_for(self, model: str) -> list[EngineRecord]:
        """The healthy engines serving ``model``."""
        return list(self.registry.candidates(model))

    def place(self, work: Work, records: list[EngineRecord]) -> EngineRecord | None:
        """The engine the global scheduler picks for ``work`` among ``records``."""
        return self.scheduler.place(work, records)

    def best(self, work: Work, records: list[EngineRecord]) -> EngineRecord | None:
        """``place``'s pick, not yet remembered as placed there (``placed``, once it went)."""
        return self.scheduler.best(work, records)

    def placed(self, work: Work, record: EngineRecord) -> None:
        """``work`` went to ``record``'s engine: it holds the work's prefix from now on."""
        self.scheduler.placed(work, record)

    @property
    def retries(self) -> int:
        """How many more engines a failed request may be tried on ([routing] num_retries)."""
        return self.config.routing.num_retries

    # ------------------------------------------------------------ validation

    def check(self, request: OpenAIRequest) -> None:
        """Cross-field rules and configured limits; raises a 4xx error."""
        request.validate()
        limit = self.config.limits.max_tokens
        wanted = request.token_limit()
        if limit is not None and wanted is not None and wanted > limit:
            raise Invalid(f"max_tokens is {wanted}, above this server's limit of {limit}",
                          param="max_tokens")
        self._check_request_tokens(request, wanted)
        if not self.registry.serves(request.model):
            raise model_not_found(request.model)

    def _check_request_tokens(self, request: OpenAIRequest, wanted: int | None) -> None:
        """n × max_tokens (× prompts) within the per-request cap; without max_tokens every choice makes
        at least one token (and gets its share of the cap: ``default_max_tokens``)."""
        cap = self.request_token_cap()
        choices = request.choices()
        total = choices * (1 if wanted is None else wanted)
        if cap is None or total <= cap:
            return
        if choices > (request.n or 1):
            param = "prompt"  # several prompts, n choices each
        elif (request.n or 1) > 1:
            param = "n"
        else:
            param = "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens"
        asked = f"{choices} choices × {wanted} max_tokens = {total} tokens" if wanted is not None else f"{choices} choices"
        raise Invalid(f"this request asks for {asked}, above this server's limit of {cap} tokens per "
                           "request (n × max_tokens)", param=param)

    # ------------------------------------------------------------ token limits

    def request_token_cap(self) -> int | None:
        """The most tokens one request may generate, all its choices together; None: no cap."""
        limits = self.config.limits
        return limits.max_request_tokens if limits.max_request_tokens is not None else limits.max_tokens

    def default_max_tokens(self, route: Route | ResponsesRoute, choices: int) -> int | None:
        """What each choice of a request without max_tokens may generate: for legacy completions 16 (as
        OpenAI and vLLM), for chat the room left in the context window (None here: only the engine
        knows it); never above the configured max_tokens, nor above the choice's share of the
        per-request cap."""
        bounds = [COMPLETIONS_DEFAULT_MAX_TOKENS if route == "completions" else None, self.config.limits.max_tokens]
        cap = self.request_token_cap()
        if cap is not None:
            bounds.append(max(1, cap // choices))
        return min((bound for bound in bounds if bound is not None), default=None)

    def max_request_tokens(self, request: OpenAIRequest) -> int | None:
        """The most tokens ``request`` (checked) may generate, as the gateway bounds it; None when only
        the engine knows (chat without max_tokens under no cap)."""
        route: Route = "completions" if isinstance(request, CompletionRequest) else "chat/completions"
        wanted = request.token_limit()
        per_choice = wanted if wanted is not None else self.default_max_tokens(route, request.choices())
        return None if per_choice is None else per_choice * request.choices()

    def token_defaults(self, route: Route | ResponsesRoute, body: dict[str, Any], engine: Engine) -> dict[str, Any]:
        """The fields that bound a request body without max_tokens on ``engine`` (none when it has one):
        ``max_tokens_limit`` for engines that take scheduling hints (the builtin one), which apply it below the room left in
        the context window (they refuse a max_tokens beyond that room); ``max_tokens`` itself for
        others, which may then refuse a prompt leaving less room than that."""
        if route == "responses":  # that API's own field; no Responses engine takes scheduling hints
            limit = self.default_max_tokens(route, 1) if body.get("max_output_tokens") is None else None
            return {} if limit is None else {"max_output_tokens": limit}
        if body.get("max_tokens") is not None or body.get("max_completion_tokens") is not None:
            return {}
        choices = (body.get("n") or 1) * (prompt_count(body.get("prompt")) if route == "completions" else 1)
        limit = self.default_max_tokens(route, choices)
        if limit is None:
            return {}
        return {"max_tokens_limit": limit} if has_capability(engine, HintedEngine) else {"max_tokens": limit}

    def _for_engine(self, route: Route | ResponsesRoute, record: EngineRecord, body: dict[str, Any],
                    hints: dict[str, Any] | None = None, placement: Placement = Placement()) -> dict[str, Any]:
        """The body as ``record``'s engine gets it: bounded (``token_defaults``), with the fields only
        engines that take scheduling hints understand (``hints``) for them alone, and the criteria as
        the ``priority`` of an engine that orders its queue by one."""
        defaults = self.token_defaults(route, body, record.engine)
        if defaults:
            body = body | defaults
        if hints and has_capability(record.engine, HintedEngine):
            body = body | hints
        elif has_capability(record.engine, PrioritizedEngine) and "priority" not in body:
            body = body | {"priority": record.engine.priority_of(placement.level)}  # type: ignore[attr-defined]
        return body

    # ------------------------------------------------------------ admission

    def _holds_criteria(self, record: EngineRecord) -> bool:
        """Whether the gateway applies criteria itself on ``record``: an engine that takes scheduling hints
        (the builtin one) orders its own queue by them."""
        return not has_capability(record.engine, HintedEngine)

    async def _admitted(self, record: EngineRecord, placement: Placement) -> None:
        """Throughput work waits while latency-critical requests of this gateway are on ``record``'s engine
        and it reports a queue ([scheduler] throughput_hold_s at most; 0: never): on an engine that does not
        order work by criteria, what it admits now would queue ahead of, or batch beside, the urgent work. Its
        queue as read in the last quarter second (asked of the engine, one request for all the waiting)."""
        hold_s = self.config.scheduler.throughput_hold_s
        if placement.level != THROUGHPUT_LEVEL or hold_s <= 0 or not self._holds_criteria(record):
            return
        deadline = time.monotonic() + hold_s
        while (record.latency_in_flight > 0 and (await record.fresh_stats(_FRESH_S)).waiting > 0
               and time.monotonic() < deadline):
            await asyncio.sleep(_HOLD_POLL_S)

    def _counts_latency(self, record: EngineRecord, placement: Placement) -> bool:
        return placement.latency and self._holds_criteria(record)

    # ------------------------------------------------------------ non-streaming

    def _attempts(self, route: Route | ResponsesRoute, model: str, body: dict[str, Any], placement: Placement
                  ) -> Attempts:
        async def describe(records: Sequence[EngineRecord]) -> Work:
            return await self.work(route, body, placement, records)

        usable = _speaks_responses if route == "responses" else None  # that API's requests go only where it is spoken
        return Attempts(self.registry, self.scheduler, self.config.routing, model, body, describe, usable,
                        lambda work, record: self.events.expect(record, work.token_ids))

    async def work(self, route: Route | ResponsesRoute, body: dict[str, Any], placement: Placement,
                   records: Sequence[EngineRecord]) -> Work:
        """The request as the scheduler sees it: its prompt's chain of byte chunks, and its token ids where some
        of ``records`` publish live KV events (a chat or completions prompt: an engine tokenizes those)."""
        prefix, tokens = prompt_prefix(route, body)
        token_ids = await self.events.token_ids(route, body, records) if route != "responses" else ()
        return Work(prefix, len(token_ids) or tokens, placement, token_ids=token_ids)

    async def create(self, route: Route | ResponsesRoute, model: str, body: dict[str, Any],
                     hints: dict[str, Any] | None = None, placement: Placement = Placement(),
                     read: Callable[[bytes], Reported | None] = read_usage) -> Answer:
        """``hints``: scheduling fields (wire.sampling.SCHEDULING_FIELDS), added for engines that take them.
        Failures are retried (gateway/attempts.py): nothing has reached the client yet. ``read`` reads the
        body, once, for the metrics; a caller that needs more of it (the semantic path: its text) passes a
        reader that takes that too, and finds what it read on the answer."""
        started = time.perf_counter()
        attempts = self._attempts(route, model, body, placement)
        while (attempt := await attempts.next()) is not None:
            record, sent = attempt
            await self._admitted(record, placement)
            sent = self._for_engine(route, record, sent, hints, placement)
            measured = self.metrics.on(model, record.engine.name)
            urgent = self._counts_latency(record, placement)
            record.latency_in_flight += urgent
            record.in_flight += 1
            measured.requests_running.inc()
            record.requests.add()
            dispatched, dispatched_at = time.perf_counter(), time.time()
            try:
                response = await record.engine.create(route, sent)
            except EngineError as exc:
                if attempts.failed(record, exc):
                    continue
                self.outcomes.failed(model, exc)
                raise
            finally:
                record.in_flight -= 1
                record.latency_in_flight -= urgent
                measured.requests_running.dec()
            record.breaker.succeeded()
            measured.queue_time.observe(dispatched - started)
            reported = read(response)
            self.outcomes.succeeded(model, record.engine.name, reported, started)
            return Answer(response, record.id, reported, dispatched_at)
        raise self.outcomes.no_engine(model, attempts.last_error)

    # ------------------------------------------------------------ embeddings

    def embedding_engines(self, model: str) -> list[EngineRecord]:
        """The healthy engines of ``model`` that compute embeddings; a 404 when the model is not served,
        a 400 naming it when it is but no engine of it embeds (a chat model, the builtin engine's)."""
        if not self.registry.serves(model):
            raise model_not_found(model)
        records = [r for r in self.registry.candidates(model) if _embeds(r)]
        if not records and not any(_embeds(r) for r in self.registry.records() if model in r.models):
            raise Invalid(f"The model `{model}` does not compute embeddings here: it is served for chat and "
                          "completions only. Ask an embedding model (configured as an upstream with "
                          "embeddings = true).", param="model", code="model_not_embedding")
        return records

    async def embed(self, model: str, body: dict[str, Any], placement: Placement = Placement()) -> Answer:
        """POST /v1/embeddings on an engine of ``model`` that embeds, retried on another one (or the same one,
        up to [routing] num_retries) when it failed in a way another attempt may not."""
        started = time.perf_counter()
        tried: set[str] = set()
        last_error: EngineError | None = None
        for _ in range(self.retries + 1):
            records = self.embedding_engines(model)
            fresh = [r for r in records if r.id not in tried] or records
            record = self.scheduler.place(Work(placement=placement), fresh)
            if record is None:
                break
            tried.add(record.id)
            record.breaker.attempt()
            measured = self.metrics.on(model, record.engine.name)
            record.in_flight += 1
            measured.requests_running.inc()
            record.requests.add()
            try:
                response = await record.engine.embed(body)  # type: ignore[attr-defined]
            except EngineError as exc:
                if retryable(exc):
                    record.breaker.failed()
                    last_error = exc
                    continue
                record.breaker.succeeded()  # it answered: the request was at fault
                self.outcomes.failed(model, exc)
                raise
            finally:
                record.in_flight -= 1
                measured.requests_running.dec()
            record.breaker.succeeded()
            self.outcomes.succeeded(model, record.engine.name, read_usage(response), started)
            return Answer(response, record.id)
        raise self.outcomes.no_engine(model, last_error)

    # ------------------------------------------------------------ streaming

    async def open_stream(self, route: Route | ResponsesRoute, model: str, body: dict[str, Any],
                          hints: dict[str, Any] | None = None,
                          placement: Placement = Placement()) -> OpenedStream:
        """Start a stream and wait for its first chunk, so failures before it still get an HTTP status.
        ``hints`` and ``placement`` as for ``create``."""
        started = time.perf_counter()
        attempts = self._attempts(route, model, body, placement)
        while (attempt := await attempts.next()) is not None:
            record, sent = attempt
            await self._admitted(record, placement)
            dispatched, dispatched_at = time.perf_counter(), time.time()
            rest = record.engine.stream(route, self._for_engine(route, record, sent, hints, placement)).__aiter__()
            try:
                first = await anext(rest, None)
            except EngineError as exc:
                if attempts.failed(record, exc):
                    continue  # before the first chunk: nothing reached the client
                self.outcomes.failed(model, exc)
                raise
            record.breaker.succeeded()
            measured = self.metrics.on(model, record.engine.name)
            measured.queue_time.observe(dispatched - started)
            record.in_flight += 1
            urgent = self._counts_latency(record, placement)
            record.latency_in_flight += urgent
            measured.requests_running.inc()
            record.requests.add()
            return OpenedStream(record=record, first=first, rest=rest, started=started, measured=measured,
                                latency=urgent, dispatched=dispatched_at)
        raise self.outcomes.no_engine(model, attempts.last_error)

    async def sse_events(self, model: str, opened: OpenedStream,
                         read: Callable[[bytes], Reported | None] = read_usage) -> AsyncIterator[bytes]:
        """SSE events, ``[DONE]`` last (in the engine's last item when it sent one); an engine failure
        mid-stream becomes an SSE error object. Times the first generated token (a chat stream's first
        event, its role, carries none) and the gaps between events that carry tokens. ``read``: how an event
        that names a usage is read (another API's stream: its own reader)."""
        reasons: list[str] = []
        done = False
        measured = opened.measured
        last_token_at = None
        try:
            events = opened.first
            while events is not None:
                if carries_token(events):
                    now = time.perf_counter()
                    if last_token_at is None:
                        measured.ttft.observe(now - opened.started)
                    else:
                        measured.itl.observe(now - last_token_at)
                    last_token_at = now
                reasons += self.outcomes.count_events(measured, events, read)
                if events.endswith(SSE_DONE):  # the client has the whole answer, whatever follows
                    done = True
                    self.outcomes.count_success(model, reasons)
                yield events
                events = await anext(opened.rest, None)
            if not done:
                self.outcomes.count_success(model, reasons)
        except EngineError as exc:
            self.outcomes.failed(model, exc)
            yield sse_event(error_payload(engine_error_body(exc)))
        finally:
            await opened.rest.aclose()  # closes the engine's stream, also when the client went away
            opened.record.in_flight -= 1
            opened.record.latency_in_flight -= opened.latency
            measured.requests_running.dec()
            measured.e2e_latency.observe(time.perf_counter() - opened.started)
        if not done:
            yield SSE_DONE


def _speaks_responses(record: EngineRecord) -> bool:
    return has_capability(record.engine, ResponsesEngine)


def _embeds(record: EngineRecord) -> bool:
    """Whether the engine serves an embedding model (an upstream configured with ``embeddings = true``): the
    capability is its class's, whether it embeds each instance's."""
    return has_capability(record.engine, EmbeddingEngine) and record.engine.embeds
