"""An httpx transport over aiohttp's connection pool: httpx's API, aiohttp's faster HTTP/1.1 handling.

httpx's own pool (httpcore) cost the gateway far more CPU per proxied request than aiohttp's.
This transport is the seam between the two: ``httpx.AsyncClient(transport=AiohttpTransport(...))``.
It does only what an engine API needs (no proxies, no redirects, no decompression: httpx decodes
content itself) and maps aiohttp's failures onto httpx's exception types, so callers see httpx only.
"""

from __future__ import annotations

import asyncio
import functools
import aiohttp
import httpx
from aiohttp.client_proto import ResponseHandler


_FAILURES = (aiohttp.ClientError, asyncio.TimeoutError)  # what aiohttp raises for a failed exchange


def _as_httpx_error(exc: BaseException) -> httpx.TransportError:
    """The httpx exception for an aiohttp failure (a plain try/except at each call: a context manager
    would cost a generator per streamed chunk)."""
    if isinstance(exc, aiohttp.ConnectionTimeoutError):  # no free connection, or no connection made, in time
        return httpx.ConnectTimeout(str(exc) or "connect timed out")
    if isinstance(exc, (aiohttp.SocketTimeoutError, aiohttp.ServerTimeoutError, asyncio.TimeoutError)):
        return httpx.ReadTimeout(str(exc) or "read timed out")
    if isinstance(exc, aiohttp.ClientConnectorError):
        return httpx.ConnectError(str(exc))
    if isinstance(exc, aiohttp.InvalidUrlClientError):
        return httpx.UnsupportedProtocol(str(exc))
    if isinstance(exc, aiohttp.ClientPayloadError):
        return httpx.ReadError(str(exc))
    return httpx.RemoteProtocolError(str(exc) or type(exc).__name__)  # the server went away, a malformed response, ...


class _ResponseHandler(ResponseHandler):
    """aiohttp's connection protocol, less a cost per HTTP chunk. aiohttp's StreamReader calls
    ``resume_reading()`` for every chunk it hands out, paused or not, and each call re-enters the
    parser with ``b""`` to resume a paused decompression (never here: ``auto_decompress=False``).
    An engine streams one HTTP chunk per token; those calls were a measurable share of the gateway's CPU
    for a proxied stream. A protocol that paused (flow control) is resumed exactly as before."""

    def resume_reading(self, resume_parser: bool = True) -> None:
        # getattr: should aiohttp rename its flags, every call goes through, as in aiohttp itself.
        if getattr(self, "_reading_paused", True) or getattr(self, "_buffer_paused", True):
            super().resume_reading(resume_parser)


def _connector(limits: httpx.Limits) -> aiohttp.TCPConnector:
    connector = aiohttp.TCPConnector(limit=limits.max_connections or 0, keepalive_timeout=limits.keepalive_expiry)
    # The protocol factory is aiohttp's own attribute: the one way to give its pool another protocol.
    connector._factory = functools.partial(_ResponseHandler, loop=asyncio.get_running_loop())
    return connector


class _ResponseStream(httpx.AsyncByteStream):
    """The body as aiohttp reads it. Its own iterator (``readany`` per step) rather than an async
    generator over aiohttp's: streamed answers take a step per token, on the gateway's hottest path."""

    def __init__(self, response: aiohttp.ClientResponse):
        self._response = response

    def __aiter__(self) -> "_ResponseStream":
        return self

    async def __anext__(self) -> bytes:
        try:
            chunk = await self._response.content.readany()
        except _FAILURES as exc:
            raise _as_httpx_error(exc) from exc
        if not chunk:
            raise StopAsyncIteration
        return chunk

    async def aclose(self) -> None:
        self._response.release()  # back to the pool if read to the end, else the connection is closed


class AiohttpTransport(httpx.AsyncBaseTransport):
    def __init__(self, limits: httpx.Limits = httpx.Limits()):
        self._limits = limits
        self._session: aiohttp.ClientSession | None = None
        self._timeouts: dict[tuple, aiohttp.ClientTimeout] = {}

    def _client_session(self) -> aiohttp.ClientSession:
        if self._session is None:  # made on first use: it binds to the running event loop
            self._session = aiohttp.ClientSession(connector=_connector(self._limits),
                                                  cookie_jar=aiohttp.DummyCookieJar(), auto_decompress=False)
        return self._session

    def _timeout(self, request: httpx.Request) -> aiohttp.ClientTimeout:
        timeout = request.extensions.get("timeout", {})
        key = (timeout.get("connect"), timeout.get("read"), timeout.get("pool"))
        if key not in self._timeouts:
            self._timeouts[key] = aiohttp.ClientTimeout(sock_connect=key[0], sock_read=key[1], connect=key[2])
        return self._timeouts[key]

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        try:
            response = await self._client_session().request(
                request.method, str(request.url), headers=request.headers, data=await request.aread() or None,
                allow_redirects=False, timeout=self._timeout(request))
        except _FAILURES as exc:
            raise _as_httpx_error(exc) from exc
        return httpx.Response(response.status, headers=response.raw_headers, stream=_ResponseStream(response),
                              request=request, extensions={"http_version": b"HTTP/1.1"})

    async def aclose(self) -> None:
        if self._session is not None:
            await self._session.close()
