"""Engine for any OpenAI-compatible server (OpenAI, vLLM, SGLang, Ollama, a builtin engine process).

All engines of a process share one ``httpx.AsyncClient`` (its owner closes it). httpx errors are
translated into ``EngineError``s here and nowhere else.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import functools
import email.utils
import http.cookiejar
import os
from typing import Any, AsyncIterator, Iterator

import httpx
import msgspec

from engines.seam import (
    EngineError,
    EngineStats,
    EngineTimeout,
    EngineUnavailable,
    Route,
)
from engines.seam.errors import engine_answered
from engines.seam.prometheus_stats import stats_from_metrics
from http_plumbing.request_context import forwarded_headers
from wire.sse import SSE_DONE, SSEFramer

_DRAIN_S = 1.0


@contextlib.contextmanager
def translate_errors(name: str) -> Iterator[None]:
    """The one place httpx failures become engine errors. Their messages reach clients: they name the engine,
    never its address (httpx's own text does: "cannot connect to 10.0.0.7:8001"), which stays in
    the cause the gateway logs."""
    try:
        yield
    except httpx.TimeoutException as exc:
        if isinstance(exc, (httpx.ConnectTimeout, httpx.PoolTimeout)):
            raise EngineUnavailable(f"engine {name!r} could not be reached (timed out connecting)") from exc
        raise EngineTimeout(f"engine {name!r} timed out") from exc
    except (httpx.ConnectError, httpx.UnsupportedProtocol) as exc:
        raise EngineUnavailable(f"engine {name!r} could not be reached") from exc
    except httpx.TransportError as exc:
        raise EngineError(f"engine {name!r} failed mid-response") from exc


class NoCookies(http.cookiejar.CookieJar):
    """The shared client's cookie jar: engine APIs set no cookies, and parsing every response for
    them was a visible part of a proxied request's cost (pass it as ``httpx.AsyncClient(cookies=NoCookies())``)."""

    def extract_cookies(self, response, request) -> None:
        return None


def _body(response: httpx.Response) -> AsyncIterator[bytes]:
    """The response body as read. Decoded only when encoded (a proxy may gzip SSE); otherwise the
    transport's own stream, without ``aiter_raw``'s bookkeeping layer (per token, on the hot path)."""
    if any(key.lower() == b"content-encoding" for key, _ in response.headers.raw):
        return response.aiter_bytes()
    return response.stream.__aiter__()  # type: ignore[union-attr]


async def _drain(body: AsyncIterator[bytes]) -> None:
    """Reads what follows ``[DONE]`` (the end of the HTTP body, normally already here), so that the
    connection goes back to the pool. The answer is complete: a failure or a server that keeps
    sending only costs the connection, closed after ``_DRAIN_S``."""
    try:
        async with asyncio.timeout(_DRAIN_S):
            async for _ in body:
                pass
    except (httpx.TransportError, TimeoutError):
        pass


def retry_after_s(headers: httpx.Headers) -> float | None:
    """The wait a response asks for: OpenAI's ``retry-after-ms``, else ``retry-after`` in seconds or as
    an HTTP date; None when absent or unreadable."""
    try:
        if "retry-after-ms" in headers:
            return max(0.0, float(headers["retry-after-ms"]) / 1000)
        value = headers.get("retry-after")
        if value is None:
            return None
        if value.strip().isdigit():
            return float(value)
        when = email.utils.parsedate_to_datetime(value)
        return max(0.0, (when - datetime.datetime.now(datetime.timezone.utc)).total_seconds())
    except (ValueError, TypeError):
        return None


def _rejected(name: str, response: httpx.Response, body: bytes) -> EngineError:
    return engine_answered(name, response.status_code, body, retry_after_s=retry_after_s(response.headers))


_CHAT_RENDERING = ("messages", "tools", "chat_template", "chat_template_kwargs", "add_generation_prompt",
                   "continue_final_message")


class _Tokenized(msgspec.Struct):
    tokens: list[int]


class UpstreamEngine:
    """Forwards requests to ``base_url`` (which ends in /v1), rewriting ``model`` to ``upstream_model``."""

    def __init__(
        self,
        name: str,
        base_url: str,
        client: httpx.AsyncClient,
        *,
        upstream_model: str | None = None,
        api_key: str | None = None,
        api_key_env: str | None = None,
        transport: httpx.AsyncBaseTransport | None = None,
        embeds: bool = False,
    ):
        """``api_key``: the bearer token itself (an engine's secret); ``api_key_env``: the name of the
        environment variable holding it (configured upstreams: the key stays out of the config)."""
        self.name = name
        self.embeds = embeds  # serves an embedding model: POST /v1/embeddings goes here (EmbeddingEngine)
        self.base_url = base_url.rstrip("/")
        self.upstream_model = upstream_model
        self._client = client
        # The client's own transport, when given: completions go straight to it, skipping the
        # client's auth, redirect and cookie layers (an engine API uses none of them), a sizeable part of the
        # CPU the gateway spends on a proxied request (docs/architecture.md, "Measurements behind design choices").
        self._transport = transport
        self._headers = [(b"content-type", b"application/json")]
        self._serves_metrics = True  # until its /metrics answered 404: most hosted APIs have none
        key = api_key or (os.environ.get(api_key_env) if api_key_env else None)
        # For the engine's other clients (engines/seam/builtin_client.py), which must authenticate alike.
        self.auth_headers = {"authorization": f"Bearer {key}"} if key else {}
        if key:
            self._headers.append((b"authorization", f"Bearer {key}".encode()))
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
        the URL and merges client defaults on every call (a sizeable part of the gateway's per-request cost)."""
        url = self._urls.get(route)
        if url is None:
            url = self._urls[route] = httpx.URL(f"{self.base_url}/{route}")
        payload = self._payload(body)
        # The body as a ready stream, with the headers httpx would add (host, content-length) already
        # there: far cheaper than ``content=``, whose encoding pass was a measurable share of the gateway's CPU.
        # With the x-request-id of the request it is made for: the engine logs it on its lines about it.
        headers = [(b"host", url.netloc), *self._headers, *forwarded_headers(),
                   (b"content-length", b"%d" % len(payload))]
        return httpx.Request("POST", url, headers=headers, stream=httpx.ByteStream(payload), extensions=self._timeout)

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

    async def embed(self, body: dict[str, Any]) -> bytes:
        """POST /v1/embeddings, passed through as chat requests are."""
        return await self.create("embeddings", body)  # type: ignore[arg-type]  # a path, as a Route is

    async def stream(self, route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
        request = self._request(route, body)
        with translate_errors(self.name):
            response = await self._send(request, stream=True)
        try:
            if response.status_code >= 400:
                with translate_errors(self.name):
                    raise _rejected(self.name, response, await response.aread())
            framer, body = SSEFramer(), _body(response)
            with translate_errors(self.name):
                async for chunk in body:
                    events = framer.feed(chunk)
                    if framer.done:
                        # With its last events: a gateway forwards the end of the answer in one write.
                        yield events + SSE_DONE
                        break
                    if events:
                        yield events
            if framer.done:
                await _drain(body)
        finally:
            await response.aclose()

    async def get_json(self, path: str) -> Any:
        with translate_errors(self.name):
            response = await self._client.get(f"{self.base_url}/{path}", headers=self._headers)
        if response.status_code >= 400:
            raise _rejected(self.name, response, response.content)
        return msgspec.json.decode(response.content)

    async def tokenize(self, route: Route, body: dict[str, Any]) -> list[int]:
        """vLLM's ``POST /tokenize`` (beside /v1): a completions prompt, or chat messages with the fields that
        shape their rendering (TokenizingEngine)."""
        sent: dict[str, Any] = {"model": self.upstream_model or body.get("model")}
        if route == "completions":
            sent["prompt"] = body.get("prompt")
        else:
            sent |= {key: body[key] for key in _CHAT_RENDERING if key in body}
        with translate_errors(self.name):
            response = await self._client.post(f"{self.base_url.removesuffix('/v1')}/tokenize", headers=self._headers,
                                               content=msgspec.json.encode(sent))
        if response.status_code >= 400:
            raise _rejected(self.name, response, response.content)
        try:
            return list(msgspec.json.decode(response.content, type=_Tokenized).tokens)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise EngineError(f"engine {self.name!r} answered /tokenize with something else") from exc

    async def health(self) -> bool:
        try:
            await self.get_json("models")
        except EngineError:
            return False
        return True

    async def stats(self) -> EngineStats:
        """Its load and KV capacity from its own ``/metrics`` (vLLM, SGLang: engines/seam/prometheus_stats.py);
        nothing known when it has none."""
        if not self._serves_metrics:
            return EngineStats()
        root = self.base_url.removesuffix("/v1")
        with translate_errors(self.name):
            response = await self._client.get(f"{root}/metrics", headers=self.auth_headers)
        if response.status_code == 404:
            self._serves_metrics = False
        if response.status_code >= 400:
            return EngineStats()
        try:
            return stats_from_metrics(response.text)
        except ValueError:  # not Prometheus text
            return EngineStats()

    async def aclose(self) -> None:
        """The shared client belongs to the app; nothing of our own to close."""


class PrefillUpstreamEngine(UpstreamEngine):
    """A vLLM or SGLang server with prefix caching (interface.PrefillEngine): a prefill-only request computes a
    prompt's prefix there, and its cache keeps it for the request that follows."""

    async def prefill(self, route: Route, body: dict[str, Any]) -> int:
        sent = {**body, "max_tokens": 1, "temperature": 0, "stream": False}
        if route == "chat/completions":
            # vLLM's and SGLang's chat fields: the last message is rendered open, as the longer one it begins
            # will be (no end-of-turn token, no assistant header), so the whole prompt is a prefix to keep.
            sent |= {"add_generation_prompt": False, "continue_final_message": True}
        answer = await self.create(route, sent)
        try:
            usage = msgspec.json.decode(answer).get("usage") or {}
            return int(usage.get("prompt_tokens") or 0)
        except (msgspec.DecodeError, AttributeError, TypeError, ValueError):
            return 0


class PrioritizedUpstreamEngine(UpstreamEngine):
    """A vLLM or SGLang server run with priority scheduling (interface.PrioritizedEngine). vLLM serves lower
    ``priority`` values first; SGLang higher ones, unless started with ``--schedule-low-priority-values-first``."""

    def __init__(self, *args: Any, lower_first: bool = True, **kwargs: Any):
        super().__init__(*args, **kwargs)
        self._lower_first = lower_first

    def priority_of(self, level: int) -> int:
        return level if self._lower_first else -level  # lower first: latency 0, throughput 2; else 0, -2


class ResponsesUpstreamEngine(UpstreamEngine):
    """A server that speaks OpenAI's Responses API (interface.ResponsesEngine): POST /v1/responses is posted to
    it as chat requests are (``create`` and ``stream`` with the route ``"responses"``), model rewritten, its key
    presented, its errors translated here as theirs are."""

    serves_responses = True


@functools.cache
def upstream_class(*, prioritized: bool, prefill: bool, responses: bool = False) -> type[UpstreamEngine]:
    """The engine class of an upstream with the capabilities its configuration gives it (a capability is its
    class's: connect.has_capability): the capabilities' classes combined, one class per combination."""
    bases = tuple(kind for wanted, kind in ((prefill, PrefillUpstreamEngine), (prioritized, PrioritizedUpstreamEngine),
                                            (responses, ResponsesUpstreamEngine)) if wanted)
    if len(bases) <= 1:
        return bases[0] if bases else UpstreamEngine
    name = "".join(kind.__name__.removesuffix("UpstreamEngine") for kind in bases) + "UpstreamEngine"
    return type(name, bases, {"__doc__": "An upstream with several capabilities: " +
                              ", ".join(kind.__name__ for kind in bases) + "."})
