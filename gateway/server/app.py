"""The gateway application: its lifespan owns the one httpx client, the engine registry and the metrics."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from pathlib import Path
from typing import AsyncIterator

import httpx
from litestar import Litestar
from litestar.openapi import OpenAPIConfig

from http_plumbing.aiohttp_transport import AiohttpTransport
from http_plumbing.http11 import Http11Transport
from engines.seam.upstream import NoCookies
from gateway.auth import admin_owners, api_key_guard
from gateway.circuit import CircuitBreaker
from gateway.config import GatewayConfig
from gateway.dashboard.routes import DEFAULT_BENCHMARKS_DIR
from gateway.engine_registrations import SharedRegistrations
from gateway.errors import EXCEPTION_HANDLERS
from gateway.allocator import map_large_blocks_separately
from gateway.health_checks import health_checks
from gateway.metrics import GatewayMetrics
from gateway.quotas import Quotas
from gateway.state import describe, open_store
from gateway.server.openapi import document
from gateway.registry import EngineRegistry
from gateway.batches.service import BatchService
from gateway.batches.store import BatchStorage
from gateway.messages.service import MessagesService
from gateway.responses.service import ResponsesService
from gateway.server.routes import ROUTES
from gateway.semantic.service import SemanticService
from gateway.service import Gateway
from gateway.supervisor import EngineSupervisors
from gateway.tracing import Tracing
from http_plumbing.request_context import RequestContext

log = logging.getLogger("parrot.gateway")


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


async def _sweep(semantic: SemanticService, quotas: Quotas, session_idle_ttl_s: float,
                 responses: ResponsesService) -> None:
    """Closes idle sessions, forgets the rate state of idle keys and expired stored responses, every TTL / 4
    (at least once a minute)."""
    while True:
        await asyncio.sleep(min(max(session_idle_ttl_s / 4, 0.05), 60.0))
        try:
            await semantic.close_idle_sessions()
        except Exception:  # an engine failing to free a context must not stop expiry for good
            log.exception("closing idle sessions failed")
        quotas.forget_idle()
        responses.sweep()


def create_app(config: GatewayConfig | None = None) -> Litestar:
    config = config or GatewayConfig()
    map_large_blocks_separately()  # so the memory of deleted sessions' values goes back to the OS
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a log line per proxied request costs real time
    tracing = Tracing(config.tracing)

    @contextlib.asynccontextmanager
    async def lifespan(app: Litestar) -> AsyncIterator[None]:
        client, transport = _http_client(config)
        store = open_store(config.state)
        await store.start()
        log.info("state in %s (%s)", describe(config.state), store.kind)
        app.state.store = store
        async with client, contextlib.AsyncExitStack() as closing:
            closing.push_async_callback(store.aclose)
            registry = EngineRegistry(heartbeat_timeout_s=config.engines.heartbeat_timeout_s,
                                      registration_secrets=[config.engines.registration_secret],
                                      new_breaker=functools.partial(CircuitBreaker, config.routing.breaker_failures,
                                                                    config.routing.breaker_cooldown_s))
            gateway = Gateway(config, registry, GatewayMetrics(), client, transport)
            gateway.add_upstreams()
            gateway.events.start()
            closing.push_async_callback(gateway.events.aclose)
            app.state.gateway = gateway
            app.state.registrations = registrations = SharedRegistrations(store, gateway)
            registrations.start()
            closing.push_async_callback(registrations.aclose)
            app.state.quotas = quotas = Quotas(config.quotas, store, seat_ttl_s=config.state.seat_ttl_s)
            app.state.semantic = semantic = SemanticService(gateway, config.semantic, limits_of=quotas.limits,
                                                            tracing=tracing, store=store,
                                                            lease_s=config.state.lease_s)
            app.state.responses = ResponsesService(gateway, quotas, config.responses, semantic, state=store,
                                                   lease_s=config.state.lease_s)
            app.state.messages = MessagesService(gateway, quotas, semantic)
            app.state.batches = BatchService(gateway, BatchStorage(store), config.files, quotas,
                                             lease_s=config.state.lease_s)
            app.state.batches.start()  # batches a previous process (or a replica that died) left running go on
            app.state.semantic.start()
            app.state.responses.start()  # background responses a previous process (or a dead replica) left run here
            closing.push_async_callback(app.state.responses.aclose)
            writer = app.state.semantic.mirror.writer if app.state.semantic.mirror is not None else None
            if writer is not None:
                writer.observe = gateway.metrics.state_write_latency.observe
            gateway.metrics.mirror_store(lambda: getattr(store, "errors", 0) + (writer.failures if writer else 0),
                                         lambda: writer.pending if writer else 0)
            closing.push_async_callback(app.state.semantic.aclose)
            sessions = app.state.semantic.sessions
            gateway.metrics.mirror(registry.records, sessions.all, sessions.holdings)
            app.state.admin_owners = admin_owners(config.auth)
            benchmarks_dir = config.dashboard.benchmarks_dir
            app.state.benchmarks_dir = Path(benchmarks_dir) if benchmarks_dir else DEFAULT_BENCHMARKS_DIR
            app.state.supervisor = EngineSupervisors(config, registry) if config.builtin_enabled() else None
            if app.state.supervisor is not None:
                app.state.supervisor.start()
            sweeper = asyncio.create_task(_sweep(app.state.semantic, quotas, config.semantic.session_idle_ttl_s,
                                             app.state.responses))
            try:
                yield
            finally:
                sweeper.cancel()
                await app.state.batches.aclose()  # stopped where they are: resumed on the next start
                if app.state.supervisor is not None:
                    await app.state.supervisor.aclose()
                await registry.aclose()
                tracing.shutdown()

    def upstream_health_checks(app: Litestar) -> contextlib.AbstractAsyncContextManager[None]:
        """Entered after ``lifespan`` (which made the registry), left before it."""
        return health_checks(app.state.gateway.registry, config.routing.health_check_interval_s)

    guard = api_key_guard(config.auth)
    app = document(Litestar(
        route_handlers=ROUTES,
        lifespan=[lifespan, upstream_health_checks],
        exception_handlers=EXCEPTION_HANDLERS,
        guards=[guard] if guard else None,
        request_max_body_size=config.limits.max_body_bytes,
        openapi_config=OpenAPIConfig(title="Parrot gateway", version="0.1.0", path="/docs"),
        debug=False,
        logging_config=None,  # the process's logging is configured once, by http_plumbing/logs.py
    ), config)
    # In front of routing (where litestar puts its own CORS and OpenTelemetry middleware), so that every
    # response, a 404 too, carries x-request-id, and everything a request does knows its id.
    app.asgi_handler = RequestContext(tracing.wrap(app.asgi_handler), access=config.server.access_log)
    return app
