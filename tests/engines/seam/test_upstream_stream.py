"""The end of an upstream engine's stream: ``[DONE]`` closes the last item, the connection is reused."""

from __future__ import annotations

import asyncio
import time

import httpx

from engines.seam import upstream
from http_plumbing.aiohttp_transport import AiohttpTransport
from wire.sse import SSE_DONE
from engines.seam.upstream import UpstreamEngine
from tests.support.servers import asgi_app

FIRST, LAST = b'data: {"n":1}\n\n', b'data: {"n":2}\n\n'


def sse_app(*, done: bool = True, hold_after_done_s: float = 0.0):
    """Streams FIRST, then LAST with [DONE] in one write; may keep the body open afterwards.
    Records the client port of every request, to tell new connections from reused ones."""
    ports: list[int] = []

    async def handler(scope, receive, send):
        ports.append(scope["client"][1])
        while (await receive()).get("more_body"):
            pass
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/event-stream")]})
        await send({"type": "http.response.body", "body": FIRST, "more_body": True})
        await asyncio.sleep(0.05)  # FIRST is read on its own
        await send({"type": "http.response.body", "body": LAST + (SSE_DONE if done else b""), "more_body": True})
        await asyncio.sleep(hold_after_done_s)
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    app = asgi_app(handler)
    app.ports = ports
    return app


async def streamed(url: str, times: int = 1) -> list[tuple[list[bytes], float, float]]:
    """For each of ``times`` requests in turn: the items, when the last arrived, when the stream ended."""
    results = []
    async with httpx.AsyncClient(transport=AiohttpTransport()) as client:
        engine = UpstreamEngine("up", f"{url}/v1", client, transport=client._transport)
        for _ in range(times):
            items, started, last_at = [], time.monotonic(), 0.0
            async for item in engine.stream("chat/completions", {"model": "m", "messages": []}):
                items.append(item)
                last_at = time.monotonic() - started
            results.append((items, last_at, time.monotonic() - started))
    return results


def test_done_closes_the_last_item_and_the_connection_is_reused(serve):
    app = sse_app()
    url = serve(app)
    results = asyncio.run(streamed(url, times=3))
    for items, _, _ in results:
        assert items == [FIRST, LAST + SSE_DONE]
    assert len(set(app.ports)) == 1  # drained after [DONE]: back to the pool each time


def test_a_stream_without_done_ends_with_the_body_and_no_done(serve):
    [(items, _, _)] = asyncio.run(streamed(serve(sse_app(done=False))))
    assert items == [FIRST, LAST]


def test_a_server_that_keeps_the_body_open_after_done_costs_only_its_connection(serve, monkeypatch):
    monkeypatch.setattr(upstream, "_DRAIN_S", 0.2)
    app = sse_app(hold_after_done_s=5.0)
    url = serve(app)
    [(items, last_at, ended_at), (again, _, _)] = asyncio.run(streamed(url, times=2))
    assert items == [FIRST, LAST + SSE_DONE] and again == items
    assert last_at < 2.0  # the answer's end is forwarded as soon as it arrives, not with the body's end
    assert ended_at < 2.0  # the drain gave up
    assert len(set(app.ports)) == 2  # that connection was closed, not pooled half-read
