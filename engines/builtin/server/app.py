"""The HTTP app of one builtin engine process: the OpenAI routes plus Parrot's context primitives.

Handlers are thin: litestar decodes the body into its Struct once (the only decode in this process),
the handler calls a surface of ``BuiltinEngine``, errors are answered by http_plumbing/http_errors.py. The app's lifespan owns the
``EngineCore`` (loaded off the event loop; it computes on its own thread) and, when a gateway
is configured, the task that registers this engine and keeps it alive with heartbeats.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from contextlib import aclosing, asynccontextmanager
from typing import TYPE_CHECKING, Any, AsyncIterator, Awaitable, Callable

import httpx
import msgspec
from litestar import Litestar, Request, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, JSONBody
from litestar.response import Stream
from prometheus_client import CONTENT_TYPE_LATEST

from engines.seam import EngineError, EngineStats
from http_plumbing.disconnect import CancelledOnDisconnect
from http_plumbing.http_errors import OPENAI_EXCEPTION_HANDLERS, engine_error_body, error_payload
from http_plumbing.request_context import RequestContext
from engines.builtin.config import DEFAULT_SERVED_MODEL_NAME, EngineConfig, served_model_name
from engines.builtin.errors import UnsupportedArchitecture
from engines.builtin.serving import (
    BuiltinEngine,
    EngineBadRequest,
    ContextFillRequest,
    ContextGenerateRequest,
    ContextTrimRequest,
)
from engines.builtin.server.membership import GatewayMembership, GatewayRegistration
from engines.builtin.prompt_split import PromptSplitRequest, split_prompt
from engines.builtin.serving.chat import ChatCompletions
from engines.builtin.serving.completions import Completions
from engines.seam.contexts import FillResult
from engines.seam import PromptSplit
from wire.sse import SSE_DONE, sse_event
from engines.builtin.tokenizer import text_tokens
from wire.openai import (
    ChatCompletionRequest,
    ChatMessage,
    Tool,
    CompletionRequest,
    ModelCard,
    ModelList,
    encoder,
)

if TYPE_CHECKING:
    from engines.builtin.core import EngineCore

logger = logging.getLogger(__name__)


class ModelNotFound(EngineError):
    status_code = 404
    error_type = "invalid_request_error"
    code = "model_not_found"
    param = "model"


class InvalidSecret(EngineError):
    status_code = 401
    error_type = "authentication_error"
    code = "invalid_engine_secret"


def _require_secret(secret: str) -> Callable[[ASGIConnection, BaseRouteHandler], None]:
    """A guard: only who holds the engine secret (the gateway) may use the engine, /health and /metrics aside."""
    expected = secret.encode()

    def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        if handler.opt.get("public"):
            return
        scheme, _, presented = connection.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(presented.strip().encode(), expected):
            raise InvalidSecret("This engine takes requests from its gateway only: pass the engine secret "
                                "as 'Authorization: Bearer SECRET'.")

    return guard


# ---------------------------------------------------------------- streaming


async def sse(chunks: AsyncIterator[bytes]) -> Stream:
    """An SSE response of ``chunks``; failures before the first chunk are still plain HTTP errors."""
    first = await chunks.__anext__()

    async def frames() -> AsyncIterator[bytes]:
        async with aclosing(chunks):
            yield sse_event(first)
            try:
                async for chunk in chunks:
                    yield sse_event(chunk)
            except Exception as exc:  # headers are gone: report in-band, as OpenAI does
                logger.warning("stream failed: %s", exc, exc_info=not isinstance(exc, EngineError))
                yield sse_event(error_payload(engine_error_body(exc)))
        yield SSE_DONE

    return Stream(frames(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})


async def _generation_chunks(engine: BuiltinEngine, context_id: str, request: ContextGenerateRequest) -> AsyncIterator[bytes]:
    chunks = engine.contexts.generate_stream(context_id, request)
    async with aclosing(chunks):
        async for chunk in chunks:
            yield encoder.encode(chunk)


# ---------------------------------------------------------------- routes


# Handlers that may stream return a Response: litestar then keeps each response's own media type
# (with a data return type it would stamp application/json over the SSE stream's).
def _json(body: Any) -> Response:
    return Response(encoder.encode(body), media_type="application/json")


def _engine(request: Request) -> BuiltinEngine:
    return request.app.state.engine


def _engine_serving(request: Request, model: str) -> BuiltinEngine:
    engine = _engine(request)
    if model != engine.model_name:
        raise ModelNotFound(f"model {model!r} not found; this engine serves {engine.model_name!r}")
    return engine


async def _answer(request: Request, work: Awaitable[Any]) -> Response:
    """``work``'s result as JSON; if the client disconnects first, its generation is aborted (as vLLM does)."""
    async with CancelledOnDisconnect(request.receive) as watch:
        return _json(await work)
    if watch.disconnected:
        return Response(b"", status_code=499)  # nginx's "client closed request": nobody reads it


async def _respond(request: Request, surface: ChatCompletions | Completions,
                   data: ChatCompletionRequest | CompletionRequest) -> Response:
    if data.stream:
        return await sse(surface.stream(data))
    return await _answer(request, surface.create(data))


@post("/v1/chat/completions", status_code=200)
async def chat_completions(request: Request, data: JSONBody[ChatCompletionRequest]) -> Response:
    return await _respond(request, _engine_serving(request, data.model).chats, data)


@post("/v1/completions", status_code=200)
async def completions(request: Request, data: JSONBody[CompletionRequest]) -> Response:
    return await _respond(request, _engine_serving(request, data.model).completions, data)


@post("/v1/prompt_split", status_code=200)
async def prompt_split(request: Request, data: JSONBody[PromptSplitRequest]) -> PromptSplit:
    """The prompt cut where its first variable starts: what a gateway shares as a prefix."""
    try:
        return split_prompt(data, _engine(request).render_chat)
    except msgspec.ValidationError as exc:
        raise EngineBadRequest(f"body: {exc}") from exc


class TokenizeRequest(msgspec.Struct, kw_only=True):
    """vLLM's POST /tokenize: a completions prompt, or chat messages rendered with the generation prompt."""

    model: str
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[Tool] | None = None


class Tokenized(msgspec.Struct):
    count: int
    max_model_len: int
    tokens: list[int]


@post("/tokenize", status_code=200)
async def tokenize(request: Request, data: JSONBody[TokenizeRequest]) -> Tokenized:
    """The prompt's token ids as a request with it would compute them (a gateway matches them against the KV
    events this engine publishes)."""
    engine = _engine_serving(request, data.model)
    if data.messages is not None:
        tokens = await asyncio.to_thread(engine.chats.prompt_tokens, data.messages, data.tools)
    elif data.prompt is not None:
        tokens = await asyncio.to_thread(text_tokens, engine.tokenizer, data.prompt)
    else:
        raise EngineBadRequest("give prompt or messages", "prompt")
    return Tokenized(len(tokens), engine.llm.max_model_len, tokens)


@get("/v1/models")
async def models(request: Request) -> ModelList:
    return ModelList(data=[ModelCard(id=_engine(request).model_name)])


class EngineHealth(msgspec.Struct, omit_defaults=True):
    status: str  # "ok", or "unhealthy" (HTTP 503) with the reason
    reason: str | None = None


@get("/health", public=True)
async def health(request: Request) -> Response:
    """200 while the step loop serves; 503 when its thread died or it stalled with requests waiting."""
    problem = _engine(request).problem()
    if problem is None:
        return _json(EngineHealth("ok"))
    return Response(encoder.encode(EngineHealth("unhealthy", problem)), media_type="application/json",
                    status_code=503)


@get("/v1/stats")
async def stats(request: Request) -> EngineStats:
    return await _engine(request).stats()


@get("/metrics", public=True)  # as vLLM's: counters and histograms, no prompt or output, for any scraper
async def metrics(request: Request) -> Response:
    return Response(_engine(request).metrics_text(), media_type=CONTENT_TYPE_LATEST)


@post("/v1/contexts", status_code=200)
async def fill_context(request: Request, data: JSONBody[ContextFillRequest]) -> FillResult:
    return await _engine(request).contexts.fill(data)


@post("/v1/contexts/{context_id:str}/generate", status_code=200)
async def generate_in_context(request: Request, context_id: FromPath[str], data: JSONBody[ContextGenerateRequest]) -> Response:
    engine = _engine(request)
    if data.stream:
        return await sse(_generation_chunks(engine, context_id, data))
    return await _answer(request, engine.contexts.generate(context_id, data))


@post("/v1/contexts/{context_id:str}/trim", status_code=200)
async def trim_context(request: Request, context_id: FromPath[str], data: JSONBody[ContextTrimRequest]) -> FillResult:
    return await _engine(request).contexts.trim(context_id, data)


@delete("/v1/contexts/{context_id:str}", status_code=200)
async def free_context(request: Request, context_id: FromPath[str]) -> dict[str, int]:
    return {"freed_blocks": await _engine(request).contexts.free(context_id)}


# ---------------------------------------------------------------- gateway registration


def create_app(
    config: EngineConfig | None = None,
    *,
    llm: "EngineCore | None" = None,
    model_name: str | None = None,
    registration: GatewayRegistration | None = None,
    secret: str | None = None,
    log: Callable[[str], None] = lambda message: None,
    access_log: bool = False,
) -> Litestar:
    """The engine's app. Given ``llm``, serves that (already started) core and leaves its lifetime to
    the caller; otherwise loads one from ``config`` at startup and shuts it down at exit.
    ``secret``: the engine secret shared with the gateway; every route but /health and /metrics then requires it,
    and the engine registers with it. ``access_log``: a log line per request (with its x-request-id, as
    every line logged for a request)."""
    config = config or getattr(llm, "config", None) or EngineConfig()

    @asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        started = time.perf_counter()
        core = llm
        if core is None:
            from engines.builtin.core import EngineCore

            log(f"loading {config.model or 'the default model (' + DEFAULT_SERVED_MODEL_NAME + ')'} ...")
            try:
                core = await asyncio.to_thread(EngineCore, config)
            except UnsupportedArchitecture as exc:
                log(f"cannot serve this model: {exc}")
                app.state.refusal = str(exc)  # the command line exits with families.EXIT_UNSUPPORTED_MODEL
                raise
            core.start()
        app.state.engine = BuiltinEngine(core, model_name=model_name or served_model_name(config))
        log(f"ready in {time.perf_counter() - started:.1f}s")
        try:
            async with httpx.AsyncClient(timeout=10.0) as client:
                membership = heartbeat = None
                if registration is not None:
                    membership = GatewayMembership(client, registration, app.state.engine, secret, log)
                    heartbeat = asyncio.create_task(membership.run())
                try:
                    yield
                finally:
                    if heartbeat is not None:
                        heartbeat.cancel()
                        await asyncio.gather(heartbeat, return_exceptions=True)
                        await membership.leave()
        finally:
            if llm is None:
                await asyncio.to_thread(core.shutdown)

    app = Litestar(
        route_handlers=[chat_completions, completions, prompt_split, tokenize, models, health, stats, metrics,
                        fill_context, generate_in_context, trim_context, free_context],
        lifespan=[lifespan],
        exception_handlers=OPENAI_EXCEPTION_HANDLERS,
        guards=[_require_secret(secret)] if secret else None,
        logging_config=None,  # the process's logging is configured once, by http_plumbing/logs.py
    )
    app.asgi_handler = RequestContext(app.asgi_handler, access=access_log)  # in front of routing, as the gateway's
    return app
