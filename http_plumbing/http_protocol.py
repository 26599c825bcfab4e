"""uvicorn's httptools protocol, writing a response's headers together with its first body bytes.

uvicorn writes the status line and headers as soon as the app sends ``http.response.start``, and the
body in a write of its own: two syscalls, and two wakeups of the client, for every response. On
loopback a write costs its receiver's side of TCP too, and they were ~5% of the gateway's CPU for a
proxied stream. Here the header write waits for the next write on the connection, and at the
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


class HttpProtocol(HttpToolsProtocol):
    """Pass as ``uvicorn.run(..., http=HttpProtocol)``."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(_HeldHeadersTransport(transport, self.loop))  # type: ignore[arg-type]
