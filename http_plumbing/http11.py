"""A lean HTTP/1.1 client transport for httpx, for engine APIs over plain ``http://``.

A gateway's added latency on a small box is mostly its CPU per proxied request, and the HTTP client
was the largest part of it: aiohttp spends several Python calls per HTTP chunk of a streamed answer
(parser callbacks, its StreamReader's bookkeeping, flow-control checks) and an engine streams one
chunk per token. Here httptools (the parser uvicorn serves with) feeds each connection's chunks into
a list that the body iterator takes whole. It does only what engine APIs need: a request with its
body in memory, a response streamed back, keep-alive pooling. Anything else (https, HEAD, a streamed
request body) goes to the ``fallback`` transport, as do failures' types: httpx's, as from httpcore.

Kept hand-written because benchmarks/gateway_overhead.py shows it: the gateway spent clearly less CPU per
streamed request than on the aiohttp path (itself cheaper than httpx's own pool, aiohttp_transport.py; the
figures: docs/architecture.md, "Measurements behind design choices").
"""

from __future__ import annotations

import asyncio
import time
from collections import deque

import httpx
import httptools

_HIGH_WATER = 1 << 20  # bytes read ahead of the consumer before the socket is paused
# A kept-alive connection lost this soon after a request went out on it, with no answer, was closed
# by the server before the request arrived (its keep-alive timeout): the request is sent again. Later,
# the server may have worked on it, and a completion must not be generated twice.
_RETRY_WINDOW_S = 0.1


class _Connection(asyncio.Protocol):
    """One keep-alive TCP connection, one exchange at a time; the parser's callbacks fill it."""

    def __init__(self, key: tuple[str, int]):
        self.key = key
        self.transport: asyncio.Transport | None = None
        self.closed = False
        self.discarded = False  # its pool slot given back
        self.idle_since = 0.0
        self.exchanges = 0
        self._parser = httptools.HttpResponseParser(self)
        self._waiter: asyncio.Future | None = None
        self._paused = False
        self._start_exchange()

    def _start_exchange(self) -> None:
        self.headers: list[tuple[bytes, bytes]] = []
        self.head_done = False
        self.complete = False
        self.received = False  # any byte of the response
        self.error: Exception | None = None
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._until_eof = False
        self._keep_alive = False
        self._interim = False
        self.sent_at = self.lost_at = 0.0

    # ------------------------------------------------------------ asyncio.Protocol

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        self.received = True
        try:
            self._parser.feed_data(data)
        except httptools.HttpParserError as exc:
            self._fail(httpx.RemoteProtocolError(f"malformed HTTP response: {exc}"))
            self.close()
            return
        if self._buffered > _HIGH_WATER and not self._paused and not self.complete:
            self._paused = True
            self.transport.pause_reading()

    def connection_lost(self, exc: Exception | None) -> None:
        self.closed = True
        self.lost_at = time.monotonic()
        if self._until_eof and self.head_done and exc is None:
            self.complete = True  # a body without a length ends with the connection
            self._wake()
        elif not self.complete:
            message = f"the server closed the connection mid-response: {exc}" if exc else (
                "the server closed the connection without a complete response")
            self._fail(httpx.ReadError(message) if exc else httpx.RemoteProtocolError(message))

    # ------------------------------------------------------------ httptools callbacks

    def on_header(self, name: bytes, value: bytes) -> None:
        self.headers.append((name, value))

    def on_headers_complete(self) -> None:
        if 100 <= self.status_code < 200 and self.status_code != 101:  # interim (100 Continue, 103): the answer follows
            self.headers = []
            self._interim = True
            return
        self.head_done = True
        self._until_eof = not any(name.lower() in (b"content-length", b"transfer-encoding")
                                  for name, _ in self.headers) and self.status_code not in (204, 304)
        self._keep_alive = self._parser.should_keep_alive()  # known from the head (not after the body)
        self._wake()

    def on_body(self, body: bytes) -> None:
        self._chunks.append(body)
        self._buffered += len(body)
        self._wake()

    def on_message_complete(self) -> None:
        if self._interim:
            self._interim = False
            return
        self.complete = True
        self._wake()

    # ------------------------------------------------------------ the exchange

    @property
    def status_code(self) -> int:
        return self._parser.get_status_code()

    def reusable(self) -> bool:
        return self.complete and not self.closed and not self._until_eof and self._keep_alive

    def send(self, data: bytes) -> None:
        self._start_exchange()
        self.exchanges += 1
        self.sent_at = time.monotonic()
        self.transport.write(data)

    async def head(self, timeout: float | None) -> None:
        while not self.head_done:
            if self.error is not None:
                raise self.error
            await self._wait(timeout)

    async def read(self, timeout: float | None) -> bytes:
        """The body bytes received since the last read; ``b""`` at its end."""
        while not self._chunks:
            if self.complete:  # whatever came after the answer only keeps the connection from reuse
                return b""
            if self.error is not None:
                raise self.error
            await self._wait(timeout)
        chunks, self._chunks, self._buffered = self._chunks, [], 0
        if self._paused:
            self._paused = False
            self.transport.resume_reading()
        return chunks[0] if len(chunks) == 1 else b"".join(chunks)

    def close(self) -> None:
        self.closed = True
        if self.transport is not None:
            self.transport.close()

    async def _wait(self, timeout: float | None) -> None:
        loop = asyncio.get_running_loop()
        self._waiter = waiter = loop.create_future()
        timer = None if timeout is None else loop.call_later(timeout, self._time_out, waiter)
        try:
            await waiter
        finally:
            self._waiter = None
            if timer is not None:
                timer.cancel()

    @staticmethod
    def _time_out(waiter: asyncio.Future) -> None:
        if not waiter.done():
            waiter.set_exception(httpx.ReadTimeout("timed out waiting for the server"))

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    def _fail(self, exc: Exception) -> None:
        if self.error is None:
            self.error = exc
        self._wake()


class _ResponseBody(httpx.AsyncByteStream):
    def __init__(self, pool: "Http11Transport", connection: _Connection, timeout: float | None):
        self._pool = pool
        self._connection: _Connection | None = connection
        self._timeout = timeout

    def __aiter__(self) -> "_ResponseBody":
        return self

    async def __anext__(self) -> bytes:
        if self._connection is None:
            raise StopAsyncIteration
        chunk = await self._connection.read(self._timeout)
        if not chunk:
            await self.aclose()
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        connection, self._connection = self._connection, None
        if connection is not None:
            self._pool.release(connection)


def _wire(request: httpx.Request, body: bytes) -> bytes:
    parts = [request.method.encode(), b" ", request.url.raw_path, b" HTTP/1.1\r\n"]
    for name, value in request.headers.raw:
        parts += (name, b": ", value, b"\r\n")
    if body and "content-length" not in request.headers:  # a request built without httpx's help
        parts += (b"content-length: %d\r\n" % len(body),)
    parts += (b"\r\n", body)
    return b"".join(parts)


class Http11Transport(httpx.AsyncBaseTransport):
    def __init__(self, limits: httpx.Limits = httpx.Limits(), fallback: httpx.AsyncBaseTransport | None = None):
        self._max_connections = limits.max_connections
        self._keepalive_expiry = limits.keepalive_expiry
        self._fallback = fallback or httpx.AsyncHTTPTransport(limits=limits)
        self._idle: dict[tuple[str, int], deque[_Connection]] = {}
        self._open = 0
        self._waiters: deque[asyncio.Future] = deque()  # requests waiting for the full pool
        self._closed = False

    def _handles(self, request: httpx.Request) -> bool:
        return (request.url.scheme == "http" and request.method != "HEAD"
                and "transfer-encoding" not in request.headers)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        if not self._handles(request):
            return await self._fallback.handle_async_request(request)
        timeout = request.extensions.get("timeout", {})
        key = (request.url.host, request.url.port or 80)
        wire = _wire(request, await request.aread())
        while True:
            connection = await self._connection(key, timeout)
            try:
                connection.send(wire)
                await connection.head(timeout.get("read"))
            except BaseException as exc:
                self._discard(connection)
                if self._server_closed_it_idle(connection, exc):
                    continue  # it never saw the request: safe to send on another connection
                raise
            return httpx.Response(connection.status_code, headers=connection.headers, request=request,
                                  stream=_ResponseBody(self, connection, timeout.get("read")),
                                  extensions={"http_version": b"HTTP/1.1"})

    @staticmethod
    def _server_closed_it_idle(connection: _Connection, exc: BaseException) -> bool:
        """Whether a kept-alive connection was closed by the server just as it was reused."""
        return (connection.exchanges > 1 and not connection.received
                and isinstance(exc, (httpx.RemoteProtocolError, httpx.ReadError))
                and 0 <= connection.lost_at - connection.sent_at < _RETRY_WINDOW_S)

    # ------------------------------------------------------------ the pool

    async def _connection(self, key: tuple[str, int], timeout: dict) -> _Connection:
        """An idle connection to ``key``, else a new one, waiting for the pool while it is full."""
        connection = self._idle_connection(key)
        if connection is None and not self._take_slot():
            try:
                async with asyncio.timeout(timeout.get("pool")):
                    while (connection := self._idle_connection(key)) is None and not self._take_slot():
                        await self._pool_change()
            except TimeoutError as exc:
                raise httpx.PoolTimeout("no connection became free in time") from exc
        if connection is not None:
            return connection
        try:
            return await self._connect(key, timeout.get("connect"))
        except BaseException:
            self._free_slot()
            raise

    def _idle_connection(self, key: tuple[str, int]) -> _Connection | None:
        idle = self._idle.get(key)
        now = time.monotonic()
        while idle:
            connection = idle.pop()  # the most recently used: the least likely to have been closed
            if not connection.closed and now - connection.idle_since < (self._keepalive_expiry or float("inf")):
                return connection
            self._discard(connection)
        return None

    def _take_slot(self) -> bool:
        if self._max_connections is None or self._open < self._max_connections or self._close_an_idle_connection():
            self._open += 1
            return True
        return False

    def _close_an_idle_connection(self) -> bool:
        for idle in self._idle.values():
            if idle:
                self._discard(idle.popleft())
                return True
        return False

    async def _connect(self, key: tuple[str, int], timeout: float | None) -> _Connection:
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                _, connection = await loop.create_connection(lambda: _Connection(key), *key)
        except TimeoutError as exc:
            raise httpx.ConnectTimeout(f"connecting to {key[0]}:{key[1]} timed out") from exc
        except OSError as exc:
            raise httpx.ConnectError(f"cannot connect to {key[0]}:{key[1]}: {exc}") from exc
        return connection

    async def _pool_change(self) -> None:
        """Returns once a connection went idle or was closed (or a wait before this one gave up its turn)."""
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except BaseException:
            if waiter.done() and not waiter.cancelled():
                self._notify()  # woken just as this wait ended: pass the turn on
            raise

    def _notify(self) -> None:
        while self._waiters:
            waiter = self._waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)
                return

    def release(self, connection: _Connection) -> None:
        if connection.reusable() and not self._closed:
            connection.idle_since = time.monotonic()
            self._idle.setdefault(connection.key, deque()).append(connection)
            self._notify()
        else:
            self._discard(connection)

    def _discard(self, connection: _Connection) -> None:
        connection.close()
        if not connection.discarded:
            connection.discarded = True
            self._free_slot()

    def _free_slot(self) -> None:
        self._open -= 1
        self._notify()

    async def aclose(self) -> None:
        self._closed = True  # answers still being read close their connections when done
        for idle in self._idle.values():
            while idle:
                self._discard(idle.pop())
        await self._fallback.aclose()
