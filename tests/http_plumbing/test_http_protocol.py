"""The server protocol that writes a response's headers with its first body bytes."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from http_plumbing.http_protocol import _HeldHeadersTransport
from tests.support.servers import asgi_app, serve_in_thread


class RecordingTransport:
    def __init__(self) -> None:
        self.writes: list[bytes] = []
        self.closed = False

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return self.closed

    def close(self) -> None:
        self.closed = True

    def get_write_buffer_size(self) -> int:
        return 7


HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: text/plain\r\n\r\n"


async def test_head_and_body_of_one_turn_go_out_in_one_write():
    recorder = RecordingTransport()
    transport = _HeldHeadersTransport(recorder, asyncio.get_running_loop())
    transport.write(HEAD)
    transport.write(b"hello")
    transport.write(b" world")
    assert recorder.writes == [HEAD + b"hello", b" world"]
    await asyncio.sleep(0)  # the loop's next turn has nothing left to send
    assert recorder.writes == [HEAD + b"hello", b" world"]


async def test_a_head_alone_goes_out_on_the_loops_next_turn():
    recorder = RecordingTransport()
    transport = _HeldHeadersTransport(recorder, asyncio.get_running_loop())
    transport.write(HEAD)
    assert recorder.writes == []
    await asyncio.sleep(0)
    assert recorder.writes == [HEAD]
    transport.write(b"later")
    assert recorder.writes == [HEAD, b"later"]


async def test_close_sends_a_held_head_first_and_a_closed_connection_gets_nothing():
    recorder = RecordingTransport()
    transport = _HeldHeadersTransport(recorder, asyncio.get_running_loop())
    transport.write(HEAD)
    transport.close()
    assert recorder.writes == [HEAD] and recorder.closed

    lost = RecordingTransport()
    transport = _HeldHeadersTransport(lost, asyncio.get_running_loop())
    transport.write(HEAD)
    lost.closed = True  # the peer went away before the loop's next turn
    await asyncio.sleep(0)
    assert lost.writes == []
    assert transport.get_write_buffer_size() == 7  # the rest is the real transport's


def _slow_body_app(release: threading.Event):
    async def handler(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        while not release.is_set():
            await asyncio.sleep(0.01)
        await send({"type": "http.response.body", "body": b"done"})
    return asgi_app(handler)


@pytest.mark.timeout(30)
def test_headers_reach_the_client_before_a_slow_body():
    """Over a real uvicorn server: the head is not held back until the body is ready."""
    release = threading.Event()
    with serve_in_thread(_slow_body_app(release)) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET / HTTP/1.1\r\nhost: x\r\n\r\n")
            head = sock.recv(65536)
            assert head.startswith(b"HTTP/1.1 200 OK\r\n") and head.endswith(b"\r\n\r\n")
            release.set()
            body = b""
            while not body.endswith(b"0\r\n\r\n"):
                body += sock.recv(65536)
            assert b"done" in body
