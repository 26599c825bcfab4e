"""The aiohttp transport (https engines), against real servers on loopback: what is its own.
(What it shares with the HTTP/1.1 transport: test_transports.py.)"""

from __future__ import annotations

import asyncio

import httpx
import pytest
from aiohttp.client_proto import ResponseHandler

from benchmarks import fake_upstream
from engines.aiohttp_transport import AiohttpTransport

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}]}


@pytest.fixture(scope="module")
def upstream(serve_module) -> str:
    return serve_module(fake_upstream.app)


def run(test, **client_options):
    async def with_client():
        async with httpx.AsyncClient(transport=AiohttpTransport(), **client_options) as client:
            return await test(client)

    return asyncio.run(with_client())


def test_a_stream_read_as_it_comes_never_re_enters_the_parser(upstream, monkeypatch):
    """aiohttp's own protocol re-enters its parser once per HTTP chunk (one per token); the pool's
    protocol skips that while nothing is paused (this fails if the pool no longer uses it)."""
    resumes = []
    resume_reading = ResponseHandler.resume_reading
    monkeypatch.setattr(ResponseHandler, "resume_reading",
                        lambda self, *args: resumes.append(1) or resume_reading(self, *args))

    async def test(client: httpx.AsyncClient):
        body = {**CHAT, "stream": True, "fake": {"words": 30}}
        async with client.stream("POST", f"{upstream}/v1/chat/completions", json=body) as response:
            return b"".join([chunk async for chunk in response.aiter_raw()])

    streamed = run(test)

    assert streamed.count(b"data: ") == 33 and streamed.endswith(b"data: [DONE]\n\n")
    assert resumes == []


def test_a_large_body_read_slowly_arrives_whole(serve, monkeypatch):
    """Flow control: a reader that falls behind pauses the connection, which must resume again
    (the transport's protocol skips aiohttp's resume calls only while nothing is paused)."""
    pauses = []
    pause_reading = ResponseHandler.pause_reading
    monkeypatch.setattr(ResponseHandler, "pause_reading", lambda self: pauses.append(1) or pause_reading(self))
    pieces = [bytes([i % 251]) * 65536 for i in range(160)]  # 10 MiB in HTTP chunks of 64 KiB

    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    url = serve(app)

    async def test(client: httpx.AsyncClient):
        received, reads = bytearray(), 0
        async with asyncio.timeout(30), client.stream("GET", url) as response:  # a connection never resumed hangs
            async for chunk in response.aiter_raw():
                received += chunk
                reads += 1
                if reads % 8 == 0:
                    await asyncio.sleep(0.01)  # let the server get ahead: aiohttp pauses reading
        return bytes(received)

    assert run(test) == b"".join(pieces)
    assert pauses  # the slow reader did make aiohttp pause
