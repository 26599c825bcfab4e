"""The server protocol that writes a response's headers with its first body bytes."""

from __future__ import annotations

import asyncio
import socket
import threading

import pytest

from http_plumbing.http_protocol import HttpProtocol, _HeldHeadersTransport
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


def _ok_app():
    async def handler(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
        await send({"type": "http.response.body", "body": b"ok"})
    return asgi_app(handler)


def _exchange(url: str, request: bytes) -> bytes:
    """``request`` sent whole; everything the server answers until it closes (or 10 s pass): a request that keeps
    its connection alive waits for the server's keep-alive timeout, so the 200s here ask for ``connection: close``."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(request)
        except ConnectionError:  # closed while the rest was still on its way: its answer was read
            pass
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
            if b"\r\n\r\nok" in answer:
                break
        return answer


@pytest.mark.timeout(60)
def test_a_request_head_beyond_its_limit_is_a_431_and_one_within_is_served():
    """A 20 MB header was once read whole and answered 200 (16 times the limit shows the same here)."""
    limit = HttpProtocol.max_head_bytes
    with serve_in_thread(_ok_app()) as url:
        within = _exchange(url, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-big: " + b"a" * (limit - 120) + b"\r\n\r\n")
        beyond = _exchange(url, b"GET / HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * (16 * limit) + b"\r\n\r\n")
        many = _exchange(url, b"GET / HTTP/1.1\r\nhost: x\r\n" + b"x-h: v\r\n" * (limit // 8) + b"\r\n")

    assert within.startswith(b"HTTP/1.1 200 ")
    for answer in (beyond, many):
        assert answer.startswith(b"HTTP/1.1 431 ") and b"request_header_fields_too_large" in answer


@pytest.mark.timeout(30)
def test_a_connection_whose_head_does_not_arrive_in_time_is_closed(monkeypatch):
    """A client sending nothing, or a request's head a byte now and then, was never disconnected."""
    monkeypatch.setattr(HttpProtocol, "head_timeout_s", 0.5)
    with serve_in_thread(_ok_app()) as url:
        host, port = url.removeprefix("http://").split(":")
        for opening in (b"", b"GET / HTTP/1.1\r\nhost: x\r\n"):  # silent, then a head that never ends
            with socket.create_connection((host, int(port)), timeout=10) as sock:
                sock.sendall(opening)
                assert sock.recv(65536) == b""  # closed by the server, long before the client's 10 s
        assert _exchange(url, b"GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\n\r\n").startswith(b"HTTP/1.1 200 ")
