"""HTTP client for a builtin engine's context primitives: fill (with fork), generate, free, render.

It is what the gateway uses to share prefixes: every request on a constant prefix forks one
context holding it (created by the first request to arrive) instead of recomputing it.
"""

from __future__ import annotations

from typing import Any

import httpx
import msgspec

from engines.seam import EngineRejected
from engines.builtin.types import FillResult
from engines.seam.upstream import translate_errors


class Generation(msgspec.Struct):
    text: str
    token_ids: list[int]
    finish_reason: str | None
    usage: dict[str, int]  # prompt_tokens: the request's own (a fork's text), not the context's
    context_tokens: int  # the context's tokens the generation followed


class Rendered(msgspec.Struct):
    prompt: str


class ContextClient:
    def __init__(self, name: str, base_url: str, client: httpx.AsyncClient, *,
                 auth_headers: dict[str, str] | None = None):
        """``auth_headers``: what the engine requires (its secret: ``UpstreamEngine.auth_headers``)."""
        self.name = name
        self.base_url = base_url.rstrip("/")  # ends in /v1
        self._client = client
        self._headers = {"content-type": "application/json", **(auth_headers or {})}

    async def _call(self, method: str, path: str, body: Any = None) -> bytes:
        with translate_errors(self.name):
            response = await self._client.request(
                method, f"{self.base_url}/{path}", content=None if body is None else msgspec.json.encode(body),
                headers=self._headers)
        if response.status_code >= 400:
            raise EngineRejected(f"engine {self.name!r} answered HTTP {response.status_code} to {path}",
                                 status_code=response.status_code, body=response.content)
        return response.content

    async def fill(self, *, text: str | None = None, tokens: list[int] | None = None,
                   parent_context_id: str | None = None, context_id: str | None = None,
                   if_absent: bool = False) -> FillResult:
        """Fills a context; ``if_absent``: creates ``context_id`` unless it exists, not waiting for its fill."""
        body = {k: v for k, v in (("text", text), ("tokens", tokens), ("parent_context_id", parent_context_id),
                                  ("context_id", context_id), ("if_absent", if_absent or None)) if v is not None}
        return msgspec.json.decode(await self._call("POST", "contexts", body), type=FillResult)

    async def generate(self, context_id: str, sampling: dict[str, Any], *, fork_with: str | None = None,
                       context_text: str | None = None) -> Generation:
        """Generate after the context (appending to it), or with ``fork_with``: after the context plus
        that text, in a temporary child the engine frees itself. ``context_text`` (with ``fork_with``):
        the context's text, to create it from if it does not exist yet."""
        body = {**sampling, "stream": False}
        if fork_with is not None:
            body |= {"text": fork_with, "fork": True}
            if context_text is not None:
                body["context_text"] = context_text
        return msgspec.json.decode(await self._call("POST", f"contexts/{context_id}/generate", body),
                                   type=Generation)

    async def free(self, context_id: str) -> int:
        return msgspec.json.decode(await self._call("DELETE", f"contexts/{context_id}"))["freed_blocks"]

    async def render(self, body: dict[str, Any]) -> str:
        """The engine's chat template applied to a chat request's messages (and tools)."""
        return msgspec.json.decode(await self._call("POST", "render", body), type=Rendered).prompt
