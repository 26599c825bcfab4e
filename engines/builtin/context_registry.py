"""The engine's contexts by id (the scheduler's table) and the rules for making, growing, ending and
dropping them. Every call is made under the core's lock (core.py)."""

from __future__ import annotations

import uuid

from engines.builtin.block_manager import BlockManager
from engines.builtin.context import Context
from engines.builtin.errors import ContextNotFound, PromptTooLong
from engines.builtin.scheduler import Scheduler
from engines.builtin.types import TokenEvent
from engines.seam.contexts import FillResult


class ContextRegistry:
    def __init__(self, scheduler: Scheduler, block_manager: BlockManager, max_model_len: int):
        self.scheduler = scheduler
        self.block_manager = block_manager
        self.max_model_len = max_model_len

    def get(self, context_id: str) -> Context:
        try:
            return self.scheduler.contexts[context_id]
        except KeyError:
            raise ContextNotFound(context_id) from None

    def new(self, context_id: str | None, parent_context_id: str | None, *, temporary: bool = False,
            step: int = 0) -> Context:
        """A new context (forking its parent's KV blocks); ``step``: the engine's step, for LRU."""
        context_id = context_id or uuid.uuid4().hex
        if context_id in self.scheduler.contexts:
            raise ValueError(f"context {context_id!r} already exists")
        if parent_context_id is None:
            ctx = Context(context_id, [], temporary=temporary)
        else:
            parent = self.get(parent_context_id)
            ctx = Context(context_id, parent.token_ids, temporary=temporary)
            self.block_manager.fork(parent, ctx)
        ctx.last_used = step
        self.scheduler.contexts[context_id] = ctx
        return ctx

    def check_length(self, ctx: Context, extra: int) -> None:
        if len(ctx) + extra > self.max_model_len:
            raise PromptTooLong(
                f"context {ctx.context_id!r} would hold {len(ctx) + extra} tokens, more than the maximum "
                f"context length of {self.max_model_len} tokens"
            )

    def check_prompt_length(self, tokens: list[int]) -> None:
        if len(tokens) > self.max_model_len:
            raise PromptTooLong(
                f"{len(tokens)} prompt tokens is more than the maximum context length of {self.max_model_len} tokens")

    def finish(self, ctx: Context, reason: str | None, *, delivered: bool = False) -> None:
        """Ends ``ctx``'s request: reason None completes a fill, else ends a generation."""
        deliver = ctx.deliver
        if ctx.is_fill and ctx.score_top_k is not None:
            outcome = [ctx.scores[p] for p in range(1, len(ctx))] if reason is None else None
        elif ctx.is_fill:
            cached = max(0, len(ctx) - ctx.num_computed_by_request)
            outcome = FillResult(ctx.context_id, len(ctx), cached) if reason is None else None
        else:
            outcome = None if delivered else TokenEvent(ctx.token_ids[-1] if ctx.token_ids else 0, finish_reason=reason)
        self.scheduler.remove(ctx)
        ctx.clear_request()
        if ctx.kept_when_finished and reason in ("stop", "length"):
            ctx.temporary = ctx.kept_when_finished = False
        if ctx.temporary or self.scheduler.contexts.get(ctx.context_id) is not ctx:  # freed (maybe the id reused)
            self.drop(ctx)
        if deliver is not None and (outcome is not None or reason == "abort"):
            deliver(outcome)

    def truncate(self, ctx: Context, length: int) -> None:
        """Keeps ``ctx``'s first ``length`` tokens (and their KV); the rest are forgotten."""
        del ctx.token_ids[length:]
        self.block_manager.truncate(ctx, length)

    def drop(self, ctx: Context) -> int:
        if self.scheduler.contexts.get(ctx.context_id) is ctx:
            del self.scheduler.contexts[ctx.context_id]
        ctx.num_released_blocks = self.block_manager.release(ctx)
        if ctx.on_released is not None:  # a free_context waiting for the loop to end the request
            ctx.on_released(ctx.num_released_blocks)
        return ctx.num_released_blocks
