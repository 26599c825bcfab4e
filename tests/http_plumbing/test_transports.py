"""What both client transports under the shared httpx client do alike, against real loopback servers:
httpx's API and exception types (engines/seam/upstream.py translates only those)."""

from __future__ import annotations

import asyncio
import gzip

import httpx
import pytest

from aiohttp.client_proto import ResponseHandler

from http_plumbing import http11
from http_plumbing.aiohttp_transport import AiohttpTransport
from http_plumbing.http11 import Http11Transport
from tests.support.servers import asgi_app, free_port
from tests.support.fake_upstream import CHAT

def run_over(transport: type[httpx.AsyncBaseTransport], test, **client_options):
    """``await test(client)`` with a client over a new ``transport``."""
    async def with_client():
        async with httpx.AsyncClient(transport=transport(), **client_options) as client:
            return await test(client)

    return asyncio.run(with_client())


@pytest.fixture(params=[Http11Transport, AiohttpTransport])
def run(request):
    """``run(test, **client_options)``: ``run_over`` each transport."""
    return lambda test, **client_options: run_over(request.param, test, **client_options)


def test_requests_and_responses_round_trip(run, fake_url):
    async def test(client: httpx.AsyncClient):
        models = await client.get(f"{fake_url}/v1/models")
        reply = await client.post(f"{fake_url}/v1/chat/completions?x=1", json=CHAT, headers={"x-test": "1"})
        return models, reply

    models, reply = run(test)

    assert models.status_code == 200 and models.json()["data"][0]["id"] == "fake-model"
    assert reply.json()["choices"][0]["message"]["content"] == "echo: hello there"
    assert reply.headers["content-type"] == "application/json"


def test_streams_arrive_in_pieces_and_close_early_without_reading_the_rest(run, fake_url):
    async def test(client: httpx.AsyncClient):
        body = {**CHAT, "stream": True, "fake": {"words": 50, "chunk_delay_s": 0.01}}
        # The fake's counters are its process's: other tests' streams count too.
        cancelled_before = (await client.get(f"{fake_url}/fake/stats")).json()["streams_cancelled"]
        async with client.stream("POST", f"{fake_url}/v1/chat/completions", json=body) as response:
            first = await anext(response.aiter_raw())
        async with asyncio.timeout(10):  # a safety net: the upstream notices the connection go
            while (await client.get(f"{fake_url}/fake/stats")).json()["streams_cancelled"] == cancelled_before:
                await asyncio.sleep(0.01)
        return first

    assert run(test).startswith(b"data: ")  # and the upstream saw the connection go, before the safety net


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


def test_a_slow_answer_is_a_read_timeout(run, fake_url):
    body = {**CHAT, "fake": {"delay_s": 2}}

    with pytest.raises(httpx.ReadTimeout):
        run(lambda client: client.post(f"{fake_url}/v1/chat/completions", json=body), timeout=httpx.Timeout(0.3))


def count_pauses(transport: type[httpx.AsyncBaseTransport], monkeypatch) -> list[int]:
    """A list that grows each time the transport pauses reading its socket."""
    pauses: list[int] = []
    if transport is AiohttpTransport:
        pause_reading = ResponseHandler.pause_reading
        monkeypatch.setattr(ResponseHandler, "pause_reading", lambda self: pauses.append(1) or pause_reading(self))
    else:
        monkeypatch.setattr(http11, "_HIGH_WATER", 256 * 1024)
        data_received = http11._Connection.data_received

        def counting(self, data):
            was = self._paused
            data_received(self, data)
            if self._paused and not was:
                pauses.append(1)

        monkeypatch.setattr(http11._Connection, "data_received", counting)
    return pauses


@pytest.mark.parametrize("transport", [Http11Transport, AiohttpTransport])
def test_a_large_body_read_slowly_arrives_whole(transport, serve, monkeypatch):
    """Flow control: a reader that falls behind pauses the socket, which must resume again (the aiohttp
    transport's protocol skips aiohttp's resume calls only while nothing is paused)."""
    pauses = count_pauses(transport, monkeypatch)
    pieces = [bytes([i % 251]) * 65536 for i in range(160)]  # 10 MiB in HTTP chunks of 64 KiB

    async def handler(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    url = serve(asgi_app(handler))

    async def test(client: httpx.AsyncClient):
        received, reads = bytearray(), 0
        async with asyncio.timeout(30), client.stream("GET", url) as response:  # a socket never resumed hangs
            async for chunk in response.aiter_raw():
                received += chunk
                reads += 1
                if reads % 4 == 0:
                    await asyncio.sleep(0.01)  # let the server get ahead
        return bytes(received)

    assert run_over(transport, test) == b"".join(pieces)
    assert pauses  # the slow reader did pause the socket
