"""Engine for any OpenAI-compatible server (OpenAI, vLLM, SGLang, Ollama, a builtin engine process).

All engines of a process share one ``httpx.AsyncClient`` (its owner closes it). httpx errors are
translated into ``EngineError``s here and nowhere else.
"""

from __future__ import annotations

import contextlib
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
    ):
        self.name = name
        self.base_url = base_url.rstrip("/")
        self.upstream_model = upstream_model
        self._client = client
        self._headers = {"content-type": "application/json"}
        key = os.environ.get(api_key_env) if api_key_env else None
        if key:
            self._headers["authorization"] = f"Bearer {key}"

    def __repr__(self) -> str:  # never shows the key
        return f"UpstreamEngine(name={self.name!r}, base_url={self.base_url!r})"

    def _payload(self, body: dict[str, Any]) -> bytes:
        if self.upstream_model is not None:
            body = {**body, "model": self.upstream_model}
        return msgspec.json.encode(body)

    async def create(self, route: Route, body: dict[str, Any]) -> bytes:
        with translate_errors(self.name):
            response = await self._client.post(
                f"{self.base_url}/{route}", content=self._payload(body), headers=self._headers
            )
        if response.status_code >= 400:
            raise _rejected(self.name, response, response.content)
        return response.content

    async def stream(self, route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
        request = self._client.build_request(
            "POST", f"{self.base_url}/{route}", content=self._payload(body), headers=self._headers
        )
        with translate_errors(self.name):
            response = await self._client.send(request, stream=True)
        try:
            if response.status_code >= 400:
                with translate_errors(self.name):
                    raise _rejected(self.name, response, await response.aread())
            with translate_errors(self.name):
                async for events in sse_events(response.aiter_bytes()):  # decoded: proxies may gzip SSE
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
