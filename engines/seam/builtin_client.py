"""The builtin engine's gateway-side adapter: an OpenAI-compatible engine with both capabilities of the
seam (interface.ContextEngine, interface.HintedEngine), over the engine's HTTP API.

Contexts are what the gateway shares prefixes with: every request on a constant prefix forks one context
holding it (created by the first request to arrive) instead of recomputing it. Splits are kept per
engine: calls of one app share templates (every map of a map-reduce renders the same messages), so most
skip the engine round trip.
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from typing import Any, AsyncIterator, Literal

import httpx
import msgspec

from engines.seam.contexts import FillResult, ForkPart, Generation, GenerationChunk, PromptSplit
from engines.seam.errors import EngineError, engine_answered
from engines.seam.interface import Route
from engines.seam.upstream import UpstreamEngine, translate_errors
from http_plumbing.request_context import forwarded_headers
from wire.sse import SSEFramer


class BuiltinEngineClient(UpstreamEngine):
    takes_scheduling_hints: Literal[True] = True

    def __init__(self, name: str, base_url: str, client: httpx.AsyncClient, *, max_splits: int = 256, **kwargs: Any):
        super().__init__(name, base_url, client, **kwargs)
        self._context_headers = {"content-type": "application/json", **self.auth_headers}
        # Splits by request, each fetched once: calls sent together on a new template share one fetch.
        self._splits: OrderedDict[bytes, asyncio.Future[PromptSplit]] = OrderedDict()
        self._max_splits = max_splits

    def __repr__(self) -> str:  # never shows the key
        return f"BuiltinEngineClient(name={self.name!r}, base_url={self.base_url!r})"

    def _headers_now(self) -> list[tuple[str, str] | tuple[bytes, bytes]]:
        """Its headers, with the x-request-id of the request this call is made for."""
        return [*self._context_headers.items(), *forwarded_headers()]

    async def _call(self, method: str, path: str, body: Any = None, *, encoded: bytes | None = None) -> bytes:
        content = encoded if encoded is not None else None if body is None else msgspec.json.encode(body)
        with translate_errors(self.name):
            response = await self._client.request(method, f"{self.base_url}/{path}", content=content,
                                                  headers=self._headers_now())
        if response.status_code >= 400:
            raise engine_answered(self.name, response.status_code, response.content, path=path)
        return response.content

    async def split_prompt(self, route: Route, body: dict[str, Any]) -> PromptSplit:
        request = msgspec.json.encode({"route": route, "body": body})
        split = self._splits.get(request)
        if split is None:
            split = self._splits[request] = asyncio.ensure_future(self._fetch_split(request))
            split.add_done_callback(lambda done: done.cancelled() or done.exception())  # failures: raised below
            if len(self._splits) > self._max_splits:
                self._splits.popitem(last=False)
        else:
            self._splits.move_to_end(request)
        try:
            return await asyncio.shield(split)  # one caller leaving does not cancel the others' fetch
        except BaseException:
            if split.done() and self._splits.get(request) is split:
                del self._splits[request]  # a failed (or cancelled) fetch is not kept: the next caller asks again
            raise

    async def _fetch_split(self, request: bytes) -> PromptSplit:
        return msgspec.json.decode(await self._call("POST", "prompt_split", encoded=request), type=PromptSplit)

    async def fill(self, *, text: str | None = None, tokens: list[int] | None = None,
                   parent_context_id: str | None = None, context_id: str | None = None,
                   if_absent: bool = False) -> FillResult:
        body = {k: v for k, v in (("text", text), ("tokens", tokens), ("parent_context_id", parent_context_id),
                                  ("context_id", context_id), ("if_absent", if_absent or None)) if v is not None}
        return msgspec.json.decode(await self._call("POST", "contexts", body), type=FillResult)

    async def generate_in_context(self, context_id: str, sampling: dict[str, Any], *,
                                  fork_with: str | list[ForkPart] | None = None, context_text: str | None = None,
                                  output_id: str | None = None, keep_as: str | None = None,
                                  trim: bool = False) -> Generation:
        body = _generate_body(sampling, False, fork_with, context_text, output_id, keep_as, trim)
        return msgspec.json.decode(await self._call("POST", f"contexts/{context_id}/generate", body),
                                   type=Generation)

    async def stream_in_context(self, context_id: str, sampling: dict[str, Any], *,
                                fork_with: str | list[ForkPart] | None = None, context_text: str | None = None,
                                output_id: str | None = None, keep_as: str | None = None, trim: bool = False
                                ) -> AsyncIterator[GenerationChunk]:
        body = msgspec.json.encode(_generate_body(sampling, True, fork_with, context_text, output_id, keep_as, trim))
        path = f"contexts/{context_id}/generate"
        with translate_errors(self.name):
            async with self._client.stream("POST", f"{self.base_url}/{path}", content=body,
                                           headers=self._headers_now()) as response:
                if response.status_code >= 400:
                    raise engine_answered(self.name, response.status_code, await response.aread(), path=path)
                framer = SSEFramer()
                async for read in response.aiter_bytes():
                    for event in framer.feed(read).split(b"\n\n"):
                        if event.startswith(b"data: "):
                            yield _chunk(self.name, event[6:])
                    if framer.done:
                        return
        raise EngineError(f"engine {self.name!r} ended a context stream without [DONE]")

    async def free_context(self, context_id: str) -> int:
        return msgspec.json.decode(await self._call("DELETE", f"contexts/{context_id}"))["freed_blocks"]


def _generate_body(sampling: dict[str, Any], stream: bool, fork_with: str | list[ForkPart] | None,
                   context_text: str | None, output_id: str | None, keep_as: str | None = None,
                   trim: bool = False) -> dict[str, Any]:
    body = {**sampling, "stream": stream}
    if output_id is not None:
        body["output_id"] = output_id
    if fork_with is not None:
        body |= {"text" if isinstance(fork_with, str) else "parts": fork_with, "fork": True}
        if context_text is not None:
            body["context_text"] = context_text
        if keep_as is not None:
            body["keep_as"] = keep_as
        if trim and context_text is not None:
            body["trim"] = True
    return body


def _chunk(name: str, payload: bytes) -> GenerationChunk:
    """One event of a context stream; an error event (the engine failed after answering 200) is raised."""
    if payload.startswith(b'{"error"'):
        raise EngineError(f"engine {name!r} failed mid-stream: {payload[:500].decode(errors='replace')}",
                          body=payload)
    return msgspec.json.decode(payload, type=GenerationChunk)
