"""The builtin engine behind the ``Engine`` seam: OpenAI requests in, OpenAI responses out, in the
caller's process over an ``EngineCore`` (which computes on its own thread). The HTTP app (http_app.py)
exposes it; its parts are the three surfaces chat.py, completions.py and contexts.py."""

from __future__ import annotations

import asyncio
import logging
from contextlib import aclosing
from typing import TYPE_CHECKING, Any, AsyncIterator, TypeVar

import msgspec

from engines.seam import EngineStats, Route
from wire.openai import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    Tool,
    encoder,
)
from wire.sse import sse_event
from engines.builtin.serving.errors import EngineBadRequest
from engines.builtin.serving.chat import ChatCompletions
from engines.builtin.serving.completions import Completions
from engines.builtin.serving.contexts import ContextPrimitives
from engines.builtin.serving.model_serving import Shared

if TYPE_CHECKING:
    from engines.builtin.core import EngineCore

T = TypeVar("T")
log = logging.getLogger("parrot.engine")


class BuiltinEngine:
    """The builtin engine as an ``engines.seam.Engine``; ``chats``, ``completions`` and ``contexts`` are
    its surfaces, which the HTTP app calls with the requests it decoded."""

    def __init__(self, llm: EngineCore, *, name: str = "builtin-0", model_name: str | None = None):
        self.llm = llm
        self.name = name
        self.model_name = model_name or llm.model_name
        llm.metrics.name_model(self.model_name)
        self.tokenizer = llm.tokenizer
        shared = Shared.of(llm, self.model_name)
        self.chats = ChatCompletions(shared)
        self.completions = Completions(shared)
        self.contexts = ContextPrimitives(shared)
        self._problem: str | None = None

    def render_chat(self, messages: list[ChatMessage], tools: list[Tool] | None = None) -> str:
        return self.chats.render_chat(messages, tools)

    # The seam takes bodies as dicts (in-process callers); the HTTP app has decoded its Structs already.

    async def create(self, route: Route, body: dict[str, Any]) -> bytes:
        if route == "chat/completions":
            return encoder.encode(await self.chats.create(_parse(body, ChatCompletionRequest)))
        if route == "completions":
            return encoder.encode(await self.completions.create(_parse(body, CompletionRequest)))
        raise EngineBadRequest(f"unknown route {route!r}")

    async def stream(self, route: Route, body: dict[str, Any]) -> AsyncIterator[bytes]:
        if route == "chat/completions":
            chunks = self.chats.stream(_parse(body, ChatCompletionRequest))
        elif route == "completions":
            chunks = self.completions.stream(_parse(body, CompletionRequest))
        else:
            raise EngineBadRequest(f"unknown route {route!r}")
        async with aclosing(chunks):
            async for chunk in chunks:
                yield sse_event(chunk)

    async def health(self) -> bool:
        return self.problem() is None

    def problem(self) -> str | None:
        """Why the engine cannot serve now (its step loop is dead or stalled); None when it can. Logged
        when it changes, not on every probe."""
        problem = self.llm.step_loop_problem()
        if problem != self._problem:
            if problem is None:
                log.info("healthy again")
            else:
                log.error("unhealthy: %s", problem)
            self._problem = problem
        return problem

    def metrics_text(self) -> bytes:
        """Its Prometheus metrics, under vLLM's names (engines/builtin/prometheus_metrics.py)."""
        return self.llm.metrics.render()

    async def stats(self) -> EngineStats:
        return self.llm.stats()

    async def aclose(self) -> None:
        await asyncio.to_thread(self.llm.shutdown)



def _parse(body: dict[str, Any], request_type: type[T]) -> T:
    try:
        return msgspec.convert(body, request_type)
    except msgspec.ValidationError as exc:
        raise EngineBadRequest(str(exc)) from exc
