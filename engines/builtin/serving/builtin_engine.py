"""The builtin engine in its process: OpenAI requests in, OpenAI responses out, over an ``EngineCore`` (which
computes on its own thread). The HTTP app (engines/builtin/server/app.py) exposes it, and gateways reach it
over HTTP through the seam's ``BuiltinEngineClient``; its parts are the three surfaces chat.py, completions.py
and contexts.py."""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

from engines.seam import EngineStats
from wire.openai import ChatMessage, Tool
from engines.builtin.serving.chat import ChatCompletions
from engines.builtin.serving.completions import Completions
from engines.builtin.serving.contexts import ContextPrimitives
from engines.builtin.serving.model_serving import Shared

if TYPE_CHECKING:
    from engines.builtin.core import EngineCore

log = logging.getLogger("parrot.engine")


class BuiltinEngine:
    """``chats``, ``completions`` and ``contexts`` are its surfaces, which the HTTP app calls with the requests it
    decoded; health, stats and metrics are what its routes and its gateway registration report."""

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
