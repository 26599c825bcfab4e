"""HTTP handlers: thin, typed, and all alike — validate, hand to the Gateway service, shape the reply.
(The two proxied OpenAI POSTs, the hot path, are plain ASGI handlers: gateway/openai_endpoints.py.)"""

from __future__ import annotations

import msgspec
from litestar import Response, get, post
from litestar.datastructures import State
from litestar.params import FromPath, JSONBody

from engines.base import EngineStats
from engines.protocol import ModelCard, ModelList
from gateway.errors import APIError, model_not_found
from gateway.openai_endpoints import chat_completions, completions
from gateway.semantic.routes import SEMANTIC_ROUTES
from gateway.service import Gateway

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


class HealthReport(msgspec.Struct):
    status: str
    engines: int
    healthy_engines: int


@get("/health", exclude_from_auth=True)
async def health(state: State) -> Response:
    gateway: Gateway = state.gateway
    models = gateway.registry.models()
    healthy = {r.id for m in models for r in gateway.registry.candidates(m)}
    report = HealthReport(status="ok" if healthy else "degraded", engines=len(gateway.registry.records()),
                          healthy_engines=len(healthy))
    return Response(msgspec.json.encode(report), media_type=JSON, status_code=200 if healthy else 503)


@get("/metrics", exclude_from_auth=True)
async def metrics(state: State) -> Response:
    gateway: Gateway = state.gateway
    gateway.metrics.prefix_hit_tokens.set(sum(r.stats.prefix_hit_tokens for r in gateway.registry.records()))
    gateway.metrics.shared_prefix_fork_tokens.set(state.semantic.prefixes.hit_tokens)
    for model in gateway.registry.models():
        gateway.metrics.engines_healthy.labels(model).set(sum(1 for _ in gateway.registry.candidates(model)))
    return Response(gateway.metrics.render(), media_type="text/plain; version=0.0.4")


# ---------------------------------------------------------------- engine registration


class EngineRegistration(msgspec.Struct):
    name: str
    url: str  # the engine's base URL, without /v1
    models: list[str]
    kind: str = "builtin"


class EngineInfo(msgspec.Struct):
    id: str
    name: str
    kind: str
    url: str | None
    models: list[str]
    healthy: bool
    in_flight: int
    stats: EngineStats


class Registered(msgspec.Struct):
    id: str


@post("/v1/engines", status_code=201)
async def register_engine(data: JSONBody[EngineRegistration], state: State) -> Registered:
    return Registered(id=state.gateway.register_remote(data.name, data.url, data.models, data.kind))


@post("/v1/engines/{engine_id:str}/heartbeat", status_code=200)
async def engine_heartbeat(engine_id: FromPath[str], data: JSONBody[EngineStats], state: State) -> Registered:
    if not state.gateway.registry.heartbeat(engine_id, data):
        raise APIError(404, f"engine {engine_id!r} is not registered", code="engine_not_found")
    return Registered(id=engine_id)


@get("/v1/engines")
async def list_engines(state: State) -> list[EngineInfo]:
    registry = state.gateway.registry
    healthy = {r.id for m in registry.models() for r in registry.candidates(m)}
    return [EngineInfo(id=r.id, name=r.engine.name, kind=r.kind, url=r.url, models=r.models,
                       healthy=r.id in healthy, in_flight=r.in_flight, stats=r.stats)
            for r in registry.records()]


ROUTES = [chat_completions, completions, list_models, get_model, health, metrics, register_engine,
          engine_heartbeat, list_engines, *SEMANTIC_ROUTES]
