"""uvicorn's httptools protocol, writing a response's headers together with its first body bytes, and
bounding what a request's head may cost: at most ``max_head_bytes`` (request line and headers; a 431
beyond) read within ``head_timeout_s`` of the connection's opening or the request's first byte (the
connection is closed after that). uvicorn bounds neither: a 20 MB header was read whole, and a client
sending a byte now and then held its connection forever.

uvicorn writes the status line and headers as soon as the app sends ``http.response.start``, and the
body in a write of its own: two syscalls, and two wakeups of the client, for every response. On
loopback a write costs its receiver's side of TCP too, and they were a measurable share of the gateway's
CPU for a proxied stream. Here the header write waits for the next write on the connection, and at the
latest for the event loop's next turn, so it is never delayed behind slow work.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_RESPONSE_HEAD = b"HTTP/1.1 "  # how uvicorn's status line (and only its interim "100 Continue") starts


class _HeldHeadersTransport:
    """A connection's transport whose writes of a response head are held for the next write."""

    __slots__ = ("_transport", "_loop", "_held")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop):
        self._transport = transport
        self._loop = loop
        self._held: bytes | None = None

    def write(self, data: bytes) -> None:
        if self._held is not None:
            data, self._held = self._held + data, None
        elif data.startswith(_RESPONSE_HEAD):
            self._held = data
            self._loop.call_soon(self.flush)
            return
        self._transport.write(data)

    def flush(self) -> None:
        if self._held is not None:
            held, self._held = self._held, None
            if not self._transport.is_closing():
                self._transport.write(held)

    def close(self) -> None:
        self.flush()
        self._transport.close()

    def is_closing(self) -> bool:
        return self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:  # everything else as the real transport
        return getattr(self._transport, name)


class HeadTooLarge(Exception):
    """Raised from the parser's callbacks: the request's head passed ``max_head_bytes``."""


class HttpProtocol(HttpToolsProtocol):
    """Pass as ``uvicorn.run(..., http=HttpProtocol)``."""

    max_head_bytes = 64 * 1024  # request line and headers, as nginx's 4 x 16 KiB large header buffers about
    head_timeout_s = 30.0  # a request's head must be whole this long after its first byte (or the connection's)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeldHeadersTransport(transport, self.loop))  # type: ignore[arg-type]
        self._head_bytes = 0
        self._head_too_large = False
        self._head_timer: asyncio.TimerHandle | None = None
        self._expect_head()

    def connection_lost(self, exc: Exception | None) -> None:
        self._head_read()
        super().connection_lost(exc)

    def _expect_head(self) -> None:
        if self._head_timer is None:
            self._head_timer = self.loop.call_later(self.head_timeout_s, self._head_timed_out)

    def _head_read(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    def _count_head(self, size: int) -> None:
        self._head_bytes += size
        if self._head_bytes > self.max_head_bytes:
            self._head_too_large = True
            raise HeadTooLarge  # httptools stops parsing; data_received answers (send_400_response)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._head_bytes = 0
        self._expect_head()

    def on_url(self, url: bytes) -> None:
        self._count_head(len(url))
        super().on_url(url)

    def on_header(self, name: bytes, value: bytes) -> None:
        self._count_head(len(name) + len(value) + 4)  # ": " and CRLF
        super().on_header(name, value)

    def on_headers_complete(self) -> None:
        self._head_read()
        super().on_headers_complete()

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request it could not parse; 431 when it was stopped for its head's size."""
        if not self._head_too_large:
            super().send_400_response(msg)
            return
        body = (b'{"error":{"message":"Request header fields too large: at most %d bytes of request line and '
                b'headers.","type":"invalid_request_error","param":null,"code":"request_header_fields_too_large"}}'
                % self.max_head_bytes)
        self.transport.write(b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
                             b"content-length: %d\r\nconnection: close\r\n\r\n%s" % (len(body), body))
        self.transport.close()
