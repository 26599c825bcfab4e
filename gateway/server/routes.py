"""HTTP handlers: thin, typed, and all alike — validate, hand to the Gateway service, shape the reply.
(The two proxied OpenAI POSTs, the hot path, are plain ASGI handlers: gateway/server/openai_endpoints.py.)"""

from __future__ import annotations

import asyncio
from typing import Annotated, Literal

import msgspec
from litestar import Request, Response, delete, get, post
from litestar.connection import ASGIConnection
from litestar.datastructures import State
from litestar.handlers import BaseRouteHandler
from litestar.params import FromPath, JSONBody

from engines.seam import EngineStats
from engines.seam.connect import CAPABILITIES, capabilities_of
from wire.openai import ModelCard, ModelList
from gateway.dashboard.routes import DASHBOARD_ROUTES
from gateway.auth import presented_key
from gateway.errors import APIError, model_not_found
from gateway.server.openai_endpoints import chat_completions, completions
from gateway.server.batch_routes import BATCH_ROUTES
from gateway.server.embeddings_routes import EMBEDDINGS_ROUTES
from gateway.server.messages_routes import MESSAGES_ROUTES
from gateway.server.responses_routes import RESPONSES_ROUTES
from gateway.semantic.routes import SEMANTIC_ROUTES
from gateway.service import Gateway
from gateway.state import StoreUnavailable

JSON = "application/json"


@get("/v1/models")
async def list_models(state: State) -> ModelList:
    return ModelList(data=[ModelCard(id=m) for m in state.gateway.registry.models()])


@get("/v1/models/{model_id:path}")
async def get_model(model_id: FromPath[str], state: State) -> ModelCard:
    model_id = model_id.lstrip("/")
    if not state.gateway.registry.serves(model_id):
        raise model_not_found(model_id)
    return ModelCard(id=model_id)


# ---------------------------------------------------------------- operations


class HealthReport(msgspec.Struct, omit_defaults=True):
    status: str  # "ok": every model served has a healthy engine; else "degraded"
    engines: int
    healthy_engines: int
    models_without_engine: list[str]  # served (or being started) with no healthy engine now
    engine_restarts: int  # exits of the engine processes the gateway started (each restarted)
    state_store: str  # where sessions, variables and quota counters live: memory, sqlite or redis
    state_store_ok: bool  # it answered a ping just now (else the gateway answers 503s that need it)
    state_writes_pending: int  # changes not yet written to it (kept, and written once it is back)
    engine_errors: list[str] = []  # why an engine it started refused to serve (not restarted), e.g. its model's architecture
    state_store_ms: float | None = None  # that ping's round trip (none when it failed)


async def _readiness(state: State) -> HealthReport:
    registry = state.gateway.registry
    models = sorted({*registry.models(), *registry.expected_models()})
    healthy_by_model = {m: {r.id for r in registry.candidates(m)} for m in models}
    without = [m for m, ids in healthy_by_model.items() if not ids]
    supervisor = state.supervisor
    store, ok, took = state.store, True, None
    try:
        took = round(await asyncio.wait_for(store.ping(), 5.0) * 1000, 3)
    except (StoreUnavailable, asyncio.TimeoutError):
        ok = False
    mirror = state.semantic.mirror
    return HealthReport(status="ok" if models and not without and ok else "degraded", engines=len(registry.records()),
                        healthy_engines=len(set().union(*healthy_by_model.values())),
                        models_without_engine=without, engine_restarts=supervisor.exits if supervisor else 0,
                        engine_errors=supervisor.refusals if supervisor else [],
                        state_store=store.kind, state_store_ok=ok, state_store_ms=took,
                        state_writes_pending=mirror.writer.pending if mirror is not None else 0)


async def _readiness_response(state: State) -> Response:
    report = await _readiness(state)
    return Response(msgspec.json.encode(report), media_type=JSON, status_code=200 if report.status == "ok" else 503)


@get("/health", exclude_from_auth=True)
async def health(state: State) -> Response:
    """Readiness with its reasons: 503 while some model has no healthy engine (or none is served), or while the
    state store does not answer."""
    return await _readiness_response(state)


@get("/health/ready", exclude_from_auth=True)
async def health_ready(state: State) -> Response:
    return await _readiness_response(state)


@get("/health/live", exclude_from_auth=True)
async def health_live() -> Response:
    """The process serves (Kubernetes liveness: whatever the engines do, restarting it helps nothing)."""
    return Response(b'{"status":"ok"}', media_type=JSON)


@get("/metrics", exclude_from_auth=True)
async def metrics(state: State) -> Response:
    gateway: Gateway = state.gateway
    gateway.metrics.prefix_hit_tokens.set(sum(r.stats.prefix_hit_tokens for r in gateway.registry.records()))
    gateway.metrics.shared_prefix_fork_tokens.set(state.semantic.prefixes.hit_tokens)
    for model in gateway.registry.models():
        gateway.metrics.engines_healthy.labels(model).set(sum(1 for _ in gateway.registry.candidates(model)))
    return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")


# ---------------------------------------------------------------- engine registration


# Engines are not clients: their routes skip the client-key guard and take engine credentials
# instead (the registration secret, then each engine's own token), JSON only, so that no client,
# and no cross-site "simple" form POST, can put itself in the path of other users' requests.


def _require_json(connection: ASGIConnection, _: BaseRouteHandler) -> None:
    media_type = connection.headers.get("content-type", "").partition(";")[0].strip().lower()
    if media_type != JSON:
        raise APIError(415, "Engine routes take application/json bodies only.", code="unsupported_media_type")


def _require_engine_secret(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    registry = connection.app.state.gateway.registry
    if not registry.secret_accepted(presented_key(connection)):
        if not registry.registration_open():  # only the gateway's own engines may register
            raise APIError(403, "Engine registration is disabled: set [engines] registration_secret "
                                "(PARROT_ENGINE_SECRET) on the gateway and the engine.",
                           code="engine_registration_disabled")
        raise APIError(401, "Engine registration needs the engine secret as 'Authorization: Bearer SECRET'.",
                       code="invalid_engine_secret")
    _require_json(connection, handler)


def _require_engine_token(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
    """The token the engine got on registration: an engine speaks only for itself."""
    registry = connection.app.state.gateway.registry
    engine_id = connection.path_params["engine_id"]
    if registry.authenticated(engine_id, presented_key(connection)) is None:
        if registry.get(engine_id) is None:
            raise APIError(404, f"engine {engine_id!r} is not registered", code="engine_not_found")
        raise APIError(401, "Pass the token this engine got on registration as 'Authorization: Bearer TOKEN'.",
                       code="invalid_engine_token")


class EngineRegistration(msgspec.Struct):
    name: Annotated[str, msgspec.Meta(min_length=1, max_length=256)]
    url: Annotated[str, msgspec.Meta(max_length=2048)]  # the engine's base URL, without /v1
    models: Annotated[list[Annotated[str, msgspec.Meta(min_length=1, max_length=256)]], msgspec.Meta(min_length=1)]
    # What the engine can do beyond OpenAI's API (engines/seam/connect.py CAPABILITIES).
    capabilities: list[Literal["contexts", "scheduling_hints"]] | None = None
    kind: Literal["builtin", "upstream"] | None = None  # before capabilities: "builtin" meant all of them

    def announced_capabilities(self) -> list[str]:
        if self.capabilities is not None:
            return list(self.capabilities)
        return list(CAPABILITIES) if self.kind in (None, "builtin") else []


class EngineInfo(msgspec.Struct):
    id: str
    name: str
    capabilities: list[str]
    url: str | None
    models: list[str]
    healthy: bool
    in_flight: int
    load: int  # what the scheduler counts: requests on it now, ours and (when reported) other clients'
    kv_use: float  # the fraction of its KV cache in use, as it reported
    held_prefix_tokens: int  # the prompt prefixes the scheduler counts on it holding: by its KV events where live, else placed
    prefix_contexts: int  # shared prefixes the gateway pinned there as contexts (semantic requests fork them)
    prefix_hit_rate: float  # of the prompt tokens it reported, the fraction served from its prefix cache or a fork
    requests_per_s: float  # requests the gateway sent it, per second over the last 10 seconds
    requests_total: int  # requests the gateway sent it
    stats: EngineStats
    pid: int | None  # the process, for engines the gateway started itself


class EngineRef(msgspec.Struct):
    id: str


class Registered(msgspec.Struct):
    id: str
    token: str  # the engine's credential for its heartbeats and deregistration


@post("/v1/engines", status_code=201, exclude_from_auth=True, guards=[_require_engine_secret])
async def register_engine(request: Request, data: JSONBody[EngineRegistration], state: State) -> Registered:
    secret = presented_key(request)
    record = await state.gateway.register_remote(data.name, data.url, data.models, data.announced_capabilities(), secret)
    await state.registrations.registered(record, data.announced_capabilities(), secret)
    return Registered(id=record.id, token=record.token)


@post("/v1/engines/{engine_id:str}/heartbeat", status_code=200, exclude_from_auth=True,
      guards=[_require_engine_token, _require_json])
async def engine_heartbeat(engine_id: FromPath[str], data: JSONBody[EngineStats], state: State) -> EngineRef:
    state.gateway.registry.heartbeat(engine_id, data)
    await state.registrations.heartbeat(engine_id)
    return EngineRef(id=engine_id)


@delete("/v1/engines/{engine_id:str}", status_code=200, exclude_from_auth=True, guards=[_require_engine_token])
async def deregister_engine(engine_id: FromPath[str], state: State) -> EngineRef:
    """An engine shutting down leaves at once (its URL is free for its successor)."""
    state.gateway.registry.remove(engine_id)
    await state.registrations.removed(engine_id)
    return EngineRef(id=engine_id)


@get("/v1/engines")
async def list_engines(state: State) -> list[EngineInfo]:
    registry = state.gateway.registry
    healthy = {r.id for m in registry.models() for r in registry.candidates(m)}
    supervisor = state.supervisor
    prefixes = state.semantic.prefixes
    return [EngineInfo(id=r.id, name=r.engine.name, capabilities=capabilities_of(r.engine), url=r.url, models=r.models,
                       healthy=r.id in healthy, in_flight=r.in_flight, load=r.load(), kv_use=r.stats.kv_use(),
                       held_prefix_tokens=state.gateway.scheduler.held_prefix_tokens(r.id),
                       prefix_contexts=prefixes.contexts_on(r.id), prefix_hit_rate=_hit_rate(r.stats),
                       requests_per_s=r.requests.per_second(), requests_total=r.requests.total, stats=r.stats,
                       pid=supervisor.pid_at(r.url) if supervisor else None)
            for r in registry.records()]


def _hit_rate(stats: EngineStats) -> float:
    return min(1.0, stats.prefix_hit_tokens / stats.prompt_tokens) if stats.prompt_tokens else 0.0


ROUTES = [chat_completions, completions, list_models, get_model, health, health_ready, health_live, metrics,
          register_engine, engine_heartbeat, deregister_engine, list_engines, *RESPONSES_ROUTES, *MESSAGES_ROUTES,
          *EMBEDDINGS_ROUTES, *BATCH_ROUTES,
          *SEMANTIC_ROUTES,
          *DASHBOARD_ROUTES]
