"""Engine for any OpenAI-compatible server (OpenAI, vLLM, SGLang, Ollama, a builtin engine process).

All engines of a process share one ``httpx.AsyncClient`` (its owner closes it). httpx errors are
translated into ``EngineError``s here and nowhere else.
"""

from __future__ import annotations

import contextlib
import http.cookiejar
import os
from typing import Any, AsyncIterator, Iterator

import httpx
import msgspec

from engines.base import (
    EngineError,
    EngineRejected,
    EngineStats,
    EngineTimeout,
    EngineUnavailable,
    Route,
)
from engines.protocol import sse_event

_DONE = b"[DONE]"


@contextlib.contextmanager
def translate_errors(name: str) -> Iterator[None]:
    """The one place httpx failures become engine errors."""
    try:
        yield
    except httpx.TimeoutException as exc:
        if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
            raise EngineUnavailable(f"engine {name!r} could not be reached: {exc!r}") from exc
        raise EngineTimeout(f"engine {name!r} timed out") from exc
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
        raise EngineUnavailable(f"engine {name!r} could not be reached: {exc}") from exc
    except httpx.TransportError as exc:
        raise EngineError(f"engine {name!r} failed mid-response: {exc!r}") from exc


async def sse_events(chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """An SSE byte stream re-framed as ``data: PAYLOAD\\n\\n`` events, up to ``[DONE]``: all the events
    of one read in one item. Comments, ids and event names are dropped; CRLF is accepted. What follows
    ``[DONE]`` is drained unparsed, so that the connection goes back to the pool."""
    buffer = b""
    done = False
    async for chunk in chunks:
        if done:
            continue
        buffer += chunk
        *events, buffer = buffer.replace(b"\r\n", b"\n").split(b"\n\n")
        out = []
        for event in events:
            for line in event.split(b"\n"):
                if not line.startswith(b"data:"):
                    continue
                payload = line[5:].strip()
                if payload == _DONE:
                    done = True
                    break
                out.append(sse_event(payload))
            if done:
                break
        if out:
            yield b"".join(out)


class NoCookies(http.cookiejar.CookieJar):
    """The shared client's cookie jar: engine APIs set no cookies, and parsing every response for
    them took ~0.1 ms of a proxied request (pass it as ``httpx.AsyncClient(cookies=NoCookies())``)."""

    def extract_cookies(self, response, request) -> None:
        return None


def _rejected(name: str, response: httpx.Response, body: bytes) -> EngineRejected:
    return EngineRejected(
        f"engine {name!r} answered HTTP {response.status_code}",
        status_code=response.status_code,
        body=body,
    )


class UpstreamEngine:
    """Forwards requests to ``base_url`` (which ends in /v1), rewriting ``model`` to ``upstream_model``."""

    def __init__(
        self,
        name: str,
        base_url: str,
        client: httpx.AsyncClient,
        *,
        upstream_model: str | None = None,
        api_key_env: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
    ):
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.upstream_model = upstream_model
        self._client = client
        # The client's own transport, when given: completions go straight to it, skipping the
        # client's auth, redirect and cookie layers (an engine API uses none of them), which cost
        # ~0.1 ms of the ~0.6 ms of CPU the gateway spends on a proxied request.
        self._transport = transport
        self._headers = {"content-type": "application/json"}
        key = os.environ.get(api_key_env) if api_key_env else None
        if key:
            self._headers["authorization"] = f"Bearer {key}"
        self._urls: dict[str, httpx.URL] = {}
        self._timeout = {"timeout": client.timeout.as_dict()}  # what client.build_request would attach

    def __repr__(self) -> str:  # never shows the key
        return f"UpstreamEngine(name={self.name!r}, base_url={self.base_url!r})"

    def _payload(self, body: dict[str, Any]) -> bytes:
        if self.upstream_model is not None:
            body = {**body, "model": self.upstream_model}
        return msgspec.json.encode(body)

    def _request(self, route: Route, body: dict[str, Any]) -> httpx.Request:
        """A ready request: built directly rather than through client.build_request, which re-parses
        the URL and merges client defaults on every call (~0.1 ms of the gateway's per-request cost)."""
        url = self._urls.get(route)
        if url is None:
            url = self._urls[route] = httpx.URL(f"{self.base_url}/{route}")
        return httpx.Request("POST", url, content=self._payload(body), headers=self._headers,
                             extensions=self._timeout)

    async def _send(self, request: httpx.Request, *, stream: bool = False) -> httpx.Response:
        if self._transport is None:
            return await self._client.send(request, stream=stream)
        response = await self._transport.handle_async_request(request)
        if not stream:
            try:
                await response.aread()
            finally:
                await response.aclose()
        return response

    async def create(self, route: Route, body: dict[str, Any]) -> bytes:
        with translate_errors(self.name):
            response = await self._send(self._request(route, body))
        if response.status_code >= 400:
            raise _rejected(self.name, response, response.content)
        return response.content

    async def stream(self, route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
        request = self._request(route, body)
        with translate_errors(self.name):
            response = await self._send(request, stream=True)
        try:
            if response.status_code >= 400:
                with translate_errors(self.name):
                    raise _rejected(self.name, response, await response.aread())
            with translate_errors(self.name):
                # Decoded only when encoded (a proxy may gzip SSE): the decoder layer costs per chunk.
                chunks = response.aiter_bytes() if "content-encoding" in response.headers else response.aiter_raw()
                async for events in sse_events(chunks):
                    yield events
        finally:
            await response.aclose()

    async def get_json(self, path: str) -> Any:
        with translate_errors(self.name):
            response = await self._client.get(f"{self.base_url}/{path}", headers=self._headers)
        if response.status_code >= 400:
            raise _rejected(self.name, response, response.content)
        return msgspec.json.decode(response.content)

    async def health(self) -> bool:
        try:
            await self.get_json("models")
        except EngineError:
            return False
        return True

    async def stats(self) -> EngineStats:
        return EngineStats()

    async def aclose(self) -> None:
        """The shared client belongs to the app; nothing of our own to close."""
