"""What both client transports under the shared httpx client do alike, against real loopback servers:
httpx's API and exception types (engines/upstream.py translates only those)."""

from __future__ import annotations

import asyncio
import gzip

import httpx
import pytest

from benchmarks import fake_upstream
from engines.aiohttp_transport import AiohttpTransport
from engines.http11 import Http11Transport
from tests.conftest import asgi_app, free_port

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture(scope="module")
def upstream(serve_module) -> str:
    return serve_module(fake_upstream.app)


@pytest.fixture(params=[Http11Transport, AiohttpTransport])
def run(request):
    """``run(test, **client_options)``: ``await test(client)`` with a client over the transport."""
    def run(test, **client_options):
        async def with_client():
            async with httpx.AsyncClient(transport=request.param(), **client_options) as client:
                return await test(client)

        return asyncio.run(with_client())

    return run


def test_requests_and_responses_round_trip(run, upstream):
    async def test(client: httpx.AsyncClient):
        models = await client.get(f"{upstream}/v1/models")
        reply = await client.post(f"{upstream}/v1/chat/completions?x=1", json=CHAT, headers={"x-test": "1"})
        return models, reply

    models, reply = run(test)

    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
    assert reply.json()["choices"][0]["message"]["content"] == "echo: hello there"
    assert reply.headers["content-type"] == "application/json"


def test_streams_arrive_in_pieces_and_close_early_without_reading_the_rest(run, upstream):
    async def test(client: httpx.AsyncClient):
        body = {**CHAT, "stream": True, "fake": {"words": 50, "chunk_delay_s": 0.01}}
        async with client.stream("POST", f"{upstream}/v1/chat/completions", json=body) as response:
            first = await anext(response.aiter_raw())
        await asyncio.sleep(0.2)
        return first, (await client.get(f"{upstream}/fake/stats")).json()

    first, stats = run(test)

    assert first.startswith(b"data: ")
    assert stats["streams_cancelled"] >= 1  # the upstream saw the connection go


def test_compressed_bodies_are_decoded_by_httpx(run, serve):
    async def handler(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"content-encoding", b"gzip")]})
        await send({"type": "http.response.body", "body": gzip.compress(b"plain words")})

    url = serve(asgi_app(handler))

    assert run(lambda client: client.get(url)).text == "plain words"


def test_a_closed_port_is_a_connect_error(run):
    with pytest.raises(httpx.ConnectError):
        run(lambda client: client.get(f"http://127.0.0.1:{free_port()}/"))


def test_a_slow_answer_is_a_read_timeout(run, upstream):
    body = {**CHAT, "fake": {"delay_s": 2}}

    with pytest.raises(httpx.ReadTimeout):
        run(lambda client: client.post(f"{upstream}/v1/chat/completions", json=body), timeout=httpx.Timeout(0.3))
