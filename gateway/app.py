"""The gateway application: its lifespan owns the one httpx client, the engine registry and the metrics."""

from __future__ import annotations

import contextlib
import itertools
import logging
import secrets
from typing import AsyncIterator

import httpx
from litestar import Litestar
from litestar.connection import ASGIConnection
from litestar.handlers import BaseRouteHandler
from litestar.openapi import OpenAPIConfig
from litestar.types import Message, Scope

from engines.aiohttp_transport import AiohttpTransport
from engines.http11 import Http11Transport
from engines.upstream import NoCookies
from gateway.config import GatewayConfig
from gateway.errors import EXCEPTION_HANDLERS, APIError
from gateway.metrics import GatewayMetrics
from gateway.registry import EngineRegistry
from gateway.routes import ROUTES
from gateway.semantic.service import SemanticService
from gateway.service import Gateway


def _http_client(config: GatewayConfig) -> tuple[httpx.AsyncClient, httpx.AsyncBaseTransport]:
    """The one client every engine shares (httpx's API over a lean HTTP/1.1 transport for http://
    engines, aiohttp for the rest), and its transport, which also serves the engines' hot path
    directly. The client owns and closes it."""
    limits = config.limits
    pool = httpx.Limits(max_connections=limits.max_connections, max_keepalive_connections=limits.max_connections)
    transport = Http11Transport(limits=pool, fallback=AiohttpTransport(limits=pool))
    client = httpx.AsyncClient(
        timeout=httpx.Timeout(limits.request_timeout_s, connect=limits.connect_timeout_s),
        limits=pool,
        transport=transport,
        cookies=NoCookies(),
    )
    return client, transport


def _require_api_key(api_keys: frozenset[str]):
    """A guard (guards also run for plain ASGI handlers, unlike before_request hooks)."""

    def guard(connection: ASGIConnection, handler: BaseRouteHandler) -> None:
        if handler.opt.get("exclude_from_auth"):
            return
        header = connection.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if scheme.lower() != "bearer" or not key:
            raise APIError(401, "You didn't provide an API key. Pass it as 'Authorization: Bearer KEY'.",
                           code="invalid_api_key")
        if key.strip() not in api_keys:
            raise APIError(401, "Incorrect API key provided.", code="invalid_api_key")

    return guard


# Request ids only need to be unique, not secret: a random per-process prefix and a counter
# (urandom per request was ~1% of the gateway's CPU for a proxied stream).
_REQUEST_ID_PREFIX = secrets.token_hex(8).encode()
_request_numbers = itertools.count()


async def _add_request_id(message: Message, scope: Scope) -> None:
    """Every response carries x-request-id: the client's own if it sent one."""
    if message["type"] != "http.response.start":
        return
    request_id = next((v for k, v in scope.get("headers", ()) if k == b"x-request-id"), None)
    if not request_id:
        request_id = b"%s%016x" % (_REQUEST_ID_PREFIX, next(_request_numbers))
    # A new list: responses may share theirs.
    message["headers"] = [*message.get("headers", ()), (b"x-request-id", request_id)]


def create_app(config: GatewayConfig | None = None) -> Litestar:
    config = config or GatewayConfig()
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a log line per proxied request costs real time

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        client, transport = _http_client(config)
        async with client:
            registry = EngineRegistry(heartbeat_timeout_s=config.builtin.heartbeat_timeout_s)
            gateway = Gateway(config, registry, GatewayMetrics(), client, transport)
            gateway.add_upstreams()
            app.state.gateway = gateway
            app.state.semantic = SemanticService(gateway, config.semantic)
            try:
                yield
            finally:
                await registry.aclose()

    api_keys = frozenset(config.auth.api_keys)
    return Litestar(
        route_handlers=ROUTES,
        lifespan=[lifespan],
        exception_handlers=EXCEPTION_HANDLERS,
        guards=[_require_api_key(api_keys)] if api_keys else None,
        before_send=[_add_request_id],
        request_max_body_size=config.limits.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Parrot gateway", version="0.1.0", path="/docs"),
        debug=False,
    )
