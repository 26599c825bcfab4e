"""The aiohttp transport (https engines), against real servers on loopback: what is its own.
(What it shares with the HTTP/1.1 transport: test_transports.py.)"""

from __future__ import annotations

import asyncio

import httpx
from aiohttp.client_proto import ResponseHandler

from http_plumbing.aiohttp_transport import AiohttpTransport
from tests.support.fake_upstream import CHAT

def run(test, **client_options):
    async def with_client():
        async with httpx.AsyncClient(transport=AiohttpTransport(), **client_options) as client:
            return await test(client)

    return asyncio.run(with_client())


def test_a_stream_read_as_it_comes_never_re_enters_the_parser(fake_url, monkeypatch):
    """aiohttp's own protocol re-enters its parser once per HTTP chunk (one per token); the pool's
    protocol skips that while nothing is paused (this fails if the pool no longer uses it)."""
    resumes = []
    resume_reading = ResponseHandler.resume_reading
    monkeypatch.setattr(ResponseHandler, "resume_reading",
                        lambda self, *args: resumes.append(1) or resume_reading(self, *args))

    async def test(client: httpx.AsyncClient):
        body = {**CHAT, "stream": True, "fake": {"words": 30}}
        async with client.stream("POST", f"{fake_url}/v1/chat/completions", json=body) as response:
            return b"".join([chunk async for chunk in response.aiter_raw()])

    streamed = run(test)

    assert streamed.count(b"data: ") == 33 and streamed.endswith(b"data: [DONE]\n\n")
    assert resumes == []
