"""The gateway's request path: pick an engine for the model, run the request, account for it."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

import httpx
import msgspec

from engines.base import EngineError, EngineOverloaded, EngineUnavailable, Route
from engines.protocol import SSE_DONE, ChatCompletionRequest, CompletionRequest, sse_event, usage_decoder
from engines.upstream import UpstreamEngine
from gateway.config import GatewayConfig
from gateway.errors import APIError, engine_error_body, error_payload, model_not_found
from gateway.metrics import GatewayMetrics
from gateway.registry import EngineRecord, EngineRegistry

OpenAIRequest = ChatCompletionRequest | CompletionRequest


class OpenedStream(msgspec.Struct):
    record: EngineRecord
    first: bytes | None
    rest: AsyncIterator[bytes]
    started: float


class Gateway:
    def __init__(self, config: GatewayConfig, registry: EngineRegistry, metrics: GatewayMetrics,
                 client: httpx.AsyncClient, transport: httpx.AsyncBaseTransport | None = None):
        self.config = config
        self.registry = registry
        self.metrics = metrics
        self.client = client
        self.transport = transport  # the client's, for the engines' hot path

    def add_upstreams(self) -> None:
        for i, upstream in enumerate(self.config.upstreams):
            engine = UpstreamEngine(upstream.name or f"upstream-{i}", upstream.base_url, self.client,
                                    upstream_model=upstream.served_model(), api_key_env=upstream.api_key_env,
                                    transport=self.transport)
            self.registry.add(engine, [upstream.model], url=upstream.base_url)

    def register_remote(self, name: str, url: str, models: list[str], kind: str) -> str:
        """An engine process announcing itself; a restarted engine at the same URL replaces its old record."""
        url = url.rstrip("/")
        for record in self.registry.records():
            if record.url == url:
                self.registry.remove(record.id)
        engine = UpstreamEngine(name, f"{url}/v1", self.client, transport=self.transport)
        return self.registry.add(engine, models, kind=kind, url=url, heartbeating=True).id

    # ------------------------------------------------------------ validation

    def check(self, request: OpenAIRequest) -> None:
        """Cross-field rules and configured limits; raises a 4xx error."""
        request.validate()
        limit = self.config.limits.max_tokens
        wanted = request.token_limit()
        if limit is not None and wanted is not None and wanted > limit:
            raise APIError(400, f"max_tokens is {wanted}, above this server's limit of {limit}",
                           param="max_tokens")
        if not self.registry.serves(request.model):
            raise model_not_found(request.model)

    @staticmethod
    def forwarded_body(raw: bytes) -> dict[str, Any]:
        """The client's body as sent (unknown fields kept for the engine), less Parrot's extension."""
        body = msgspec.json.decode(raw)
        body.pop("parrot", None)
        return body

    # ------------------------------------------------------------ non-streaming

    async def create(self, route: Route, model: str, body: dict[str, Any],
                     builtin_hints: dict[str, Any] | None = None) -> bytes:
        """``builtin_hints``: fields only builtin engines understand (scheduling), added for them alone."""
        started = time.perf_counter()
        last_error: EngineError | None = None
        for record in self.registry.candidates(model):
            record.in_flight += 1
            self.metrics.model(model).requests_running.inc()
            try:
                sent = body | builtin_hints if builtin_hints and record.kind == "builtin" else body
                response = await record.engine.create(route, sent)
            except EngineUnavailable as exc:
                self.registry.mark_down(record)
                last_error = exc
                continue  # nothing reached the client: another engine may take it
            except EngineError as exc:
                self.record_failure(model, exc)
                raise
            finally:
                record.in_flight -= 1
                self.metrics.model(model).requests_running.dec()
            self.record_success(model, response, started)
            return response
        raise self._no_engine(model, last_error)

    def record_success(self, model: str, response: bytes, started: float) -> None:
        """Metrics for a finished non-streamed request: latency, tokens, finish reasons."""
        self.metrics.model(model).e2e_latency.observe(time.perf_counter() - started)
        self._count_success(model, self._count_usage(model, response))

    def _count_success(self, model: str, reasons: list[str]) -> None:
        for reason in reasons or ["stop"]:
            self.metrics.model(model).success(reason).inc()

    def record_failure(self, model: str, exc: EngineError) -> None:
        self.metrics.model(model).error(exc.status_code).inc()

    def _count_usage(self, model: str, payload: bytes) -> list[str]:
        """Counts the tokens a body reports; returns its choices' finish reasons."""
        try:
            decoded = usage_decoder.decode(payload)
        except msgspec.DecodeError:
            return []
        if decoded.usage is not None:
            self.metrics.model(model).prompt_tokens.inc(decoded.usage.prompt_tokens)
            self.metrics.model(model).generation_tokens.inc(decoded.usage.completion_tokens)
        return [c.finish_reason for c in decoded.choices if c.finish_reason]

    def _count_events(self, model: str, events: bytes) -> list[str]:
        """Token usage and finish reasons in a run of SSE events (most carry neither: skipped unparsed)."""
        marks = [at for at in (events.find(b'"usage"'), events.find(b'"finish_reason":"')) if at >= 0]
        if not marks:
            return []
        reasons: list[str] = []
        start = events.rfind(b"\n\n", 0, min(marks))
        tail = events[start + 2:] if start >= 0 else events  # from the first marked event on
        for event in tail.split(b"\n\n"):
            if event.startswith(b"data: ") and (b'"usage"' in event or b'"finish_reason":"' in event):
                reasons += self._count_usage(model, event[6:])
        return reasons

    def _no_engine(self, model: str, last_error: EngineError | None) -> EngineError:
        if last_error is not None:
            self.record_failure(model, last_error)
            return last_error
        self.metrics.model(model).error(503).inc()
        return EngineOverloaded(f"no healthy engine serves model {model!r} right now")

    # ------------------------------------------------------------ streaming

    async def open_stream(self, route: Route, model: str, body: dict[str, Any]) -> OpenedStream:
        """Start a stream and wait for its first chunk, so failures before it still get an HTTP status."""
        started = time.perf_counter()
        last_error: EngineError | None = None
        for record in self.registry.candidates(model):
            rest = record.engine.stream(route, body).__aiter__()
            try:
                first = await anext(rest, None)
            except EngineUnavailable as exc:
                self.registry.mark_down(record)
                last_error = exc
                continue
            except EngineError as exc:
                self.record_failure(model, exc)
                raise
            self.metrics.model(model).ttft.observe(time.perf_counter() - started)
            record.in_flight += 1
            self.metrics.model(model).requests_running.inc()
            return OpenedStream(record=record, first=first, rest=rest, started=started)
        raise self._no_engine(model, last_error)

    async def sse_events(self, model: str, opened: OpenedStream) -> AsyncIterator[bytes]:
        """SSE events, ``[DONE]`` last (in the engine's last item when it sent one); an engine failure
        mid-stream becomes an SSE error object."""
        reasons: list[str] = []
        done = False
        try:
            events = opened.first
            while events is not None:
                reasons += self._count_events(model, events)
                if events.endswith(SSE_DONE):  # the client has the whole answer, whatever follows
                    done = True
                    self._count_success(model, reasons)
                yield events
                events = await anext(opened.rest, None)
            if not done:
                self._count_success(model, reasons)
        except EngineError as exc:
            self.record_failure(model, exc)
            yield sse_event(error_payload(engine_error_body(exc)))
        finally:
            await opened.rest.aclose()  # closes the engine's stream, also when the client went away
            opened.record.in_flight -= 1
            self.metrics.model(model).requests_running.dec()
            self.metrics.model(model).e2e_latency.observe(time.perf_counter() - opened.started)
        if not done:
            yield SSE_DONE
