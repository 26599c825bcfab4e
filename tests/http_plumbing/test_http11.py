"""The lean HTTP/1.1 transport, against real servers on loopback: pooling, framing, retries.
(What it shares with the aiohttp transport: test_transports.py.)"""

from __future__ import annotations

import asyncio
import socket
import struct

import httpx
import pytest

from http_plumbing.http11 import Http11Transport
from tests.support.servers import asgi_app, read_asgi_body
from tests.support.fake_upstream import CHAT

def run(test, limits: httpx.Limits = httpx.Limits(), fallback=None, **client_options):
    async def with_client():
        transport = Http11Transport(limits=limits, fallback=fallback)
        async with httpx.AsyncClient(transport=transport, **client_options) as client:
            return await test(client)

    return asyncio.run(with_client())


def counting_connections(pieces: list[bytes], pause_s: float = 0.0):
    """An app answering ``pieces`` as a chunked body; ``app.ports`` holds each request's client port."""
    ports: list[int] = []

    async def handler(scope, receive, send):
        ports.append(scope["client"][1])
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        for piece in pieces:
            await send({"type": "http.response.body", "body": piece, "more_body": True})
            await asyncio.sleep(pause_s)
        await send({"type": "http.response.body", "body": b""})

    app = asgi_app(handler)
    app.ports = ports
    return app


def test_answers_read_to_the_end_leave_their_connection_for_the_next_request(serve):
    app = counting_connections([b"one ", b"two ", b"three"])
    url = serve(app)

    async def test(client: httpx.AsyncClient):
        texts = [(await client.post(url, json=CHAT)).text for _ in range(2)]
        async with client.stream("GET", url) as response:
            texts.append(b"".join([chunk async for chunk in response.aiter_raw()]).decode())
        return texts + [(await client.get(url)).text]

    assert run(test) == ["one two three"] * 4
    assert len(set(app.ports)) == 1


def test_an_answer_closed_before_its_end_closes_its_connection(serve):
    app = counting_connections([b"one ", b"two ", b"three"], pause_s=0.05)
    url = serve(app)

    async def test(client: httpx.AsyncClient):
        async with client.stream("GET", url) as response:
            await anext(response.aiter_raw())
        return (await client.get(url)).text

    assert run(test) == "one two three"
    assert len(set(app.ports)) == 2


def test_a_server_that_hangs_up_mid_answer_is_a_transport_error(serve):
    async def handler(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"100")]})
        await send({"type": "http.response.body", "body": b"only part", "more_body": True})
        raise RuntimeError("the server fails mid-body")  # uvicorn closes the connection

    with pytest.raises(httpx.TransportError):
        run(lambda client: client.get(serve(asgi_app(handler))))


def test_a_body_without_length_ends_with_the_connection(serve):
    async def handler(scope, receive, send):
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"text/plain"), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": b"until ", "more_body": True})
        await send({"type": "http.response.body", "body": b"the end"})

    assert run(lambda client: client.get(serve(asgi_app(handler)))).text == "until the end"


def test_a_kept_alive_connection_the_server_closed_is_replaced(serve):
    """The server drops idle connections after its keep-alive timeout; a request that meets one
    goes out on a new connection instead of failing."""
    async def handler(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})

    url = serve(asgi_app(handler))

    async def test(client: httpx.AsyncClient):
        first = await client.get(url)
        transport: Http11Transport = client._transport  # type: ignore[assignment]
        [connection] = [c for idle in transport._idle.values() for c in idle]
        connection.transport.close = lambda: None  # noqa: E731 (as if the FIN were still in flight)
        connection.transport.abort()
        connection.closed = False  # not seen yet when the request goes out
        second = await client.get(url)
        return first.text, second.text

    assert run(test) == ("ok", "ok")


def test_the_pool_limit_makes_requests_wait_then_time_out(fake_url):
    async def test(client: httpx.AsyncClient):
        slow = {**CHAT, "fake": {"delay_s": 0.5}}
        answers = await asyncio.gather(*(client.post(f"{fake_url}/v1/chat/completions", json=slow) for _ in range(3)))
        with pytest.raises(httpx.PoolTimeout):
            await asyncio.gather(client.post(f"{fake_url}/v1/chat/completions", json={**CHAT, "fake": {"delay_s": 1}}),
                                 client.post(f"{fake_url}/v1/chat/completions", json=CHAT,
                                             timeout=httpx.Timeout(5, pool=0.1)))
        return answers

    answers = run(test, limits=httpx.Limits(max_connections=1))
    assert [a.status_code for a in answers] == [200, 200, 200]


def test_https_goes_to_the_fallback():
    seen = []

    class Fallback(httpx.AsyncBaseTransport):
        async def handle_async_request(self, request):
            seen.append(str(request.url))
            return httpx.Response(200, text="from the fallback")

    assert run(lambda client: client.get("https://example.invalid/x"), fallback=Fallback()).text == "from the fallback"
    assert seen == ["https://example.invalid/x"]


def test_a_request_built_by_hand_gets_its_content_length(serve):
    async def handler(scope, receive, send):
        body = await read_asgi_body(receive)
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": body[::-1]})

    url = serve(asgi_app(handler))
    request = httpx.Request("POST", url, stream=httpx.ByteStream(b"abc"), headers={"host": url[7:]})
    assert "content-length" not in request.headers
    assert run(lambda client: client.send(request)).text == "cba"


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next((int(line.split(b":")[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), 0)
    return await reader.readexactly(length)


def raw_server_run(handler, test) -> object:
    """Runs ``test(client, url)`` against an asyncio server whose connections ``handler`` serves."""
    async def main():
        server = await asyncio.start_server(handler, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}/"
        try:
            async with httpx.AsyncClient(transport=Http11Transport()) as client:
                return await test(client, url)
        finally:
            server.close()

    return asyncio.run(main())


def test_a_body_without_length_cut_by_a_reset_is_an_error():
    async def handler(reader, writer):
        await read_request(reader)
        writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\npart of the bo")
        await writer.drain()
        await asyncio.sleep(0.05)
        sock = writer.get_extra_info("socket")
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with RST
        writer.transport.abort()

    with pytest.raises(httpx.ReadError):
        raw_server_run(handler, lambda client, url: client.get(url))


def test_interim_answers_are_skipped_for_the_final_one():
    async def handler(reader, writer):
        while True:
            try:
                await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            writer.write(b"HTTP/1.1 100 Continue\r\n\r\nHTTP/1.1 103 Early Hints\r\nlink: </x>\r\n\r\n"
                         b"HTTP/1.1 200 OK\r\ncontent-length: 5\r\nx-final: 1\r\n\r\nfinal")

    async def test(client, url):
        return [await client.post(url, content=b"{}") for _ in range(2)]

    for answer in raw_server_run(handler, test):
        assert (answer.status_code, answer.text, answer.headers.get("x-final"), answer.headers.get("link")) == (
            200, "final", "1", None)


def test_a_request_the_server_worked_on_before_hanging_up_is_not_sent_again():
    seen = []

    async def handler(reader, writer):
        while True:
            try:
                body = await read_request(reader)
            except asyncio.IncompleteReadError:
                return
            seen.append(body)
            if body == b"expensive":
                await asyncio.sleep(0.5)  # works on it, then dies without answering
                writer.close()
                return
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok")

    async def test(client, url):
        await client.post(url, content=b"warm")
        with pytest.raises(httpx.RemoteProtocolError):
            await client.post(url, content=b"expensive")

    raw_server_run(handler, test)
    assert seen == [b"warm", b"expensive"]
