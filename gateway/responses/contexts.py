"""Stored responses keep their conversation's KV context on an engine with contexts (the builtin one).

When a stored turn ran on such an engine, the conversation so far (its answer included, up to where the next
user message's text would start) is filled into a named context there and pinned. A next turn with
``previous_response_id`` whose new input is one user message, on the same engine, then runs as a fork of that
context: the engine computes only the new message and what follows it. The prompt is cut by the engine itself
(``split_prompt`` with the next message as a variable), and a fork is made only when the next turn's prompt
starts with exactly the pinned text (same instructions, same conversation), so its answer is the unpinned
path's. A turn run as such a fork keeps its own context on the engine (the conversation with its answer, as
generated): its pin is that context, which the next fork trims to where the next prompt's tokens differ from it
(the template may render the answer otherwise than it was generated, e.g. its end-of-turn token) in the same
engine call, so nothing is filled again, no round trip is added to the next turn's way, and that fork computes
only what follows the common prefix. Pinned contexts are bounded (``[responses] max_pinned_contexts``, the least
recently used freed first), freed after ``context_idle_ttl_s`` unused and when their response is deleted or
forgotten by the store.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections import OrderedDict
from typing import Any, AsyncIterator, Callable, NamedTuple

import msgspec

from engines.seam import ContextEngine, EngineError, PromptSplit
from engines.seam.contexts import Generation, GenerationChunk
from engines.seam.connect import has_capability
from gateway.config import ResponsesConfig
from gateway.quotas import count_tokens
from gateway.service import Gateway
from http_plumbing.http_errors import engine_error_body
from gateway.translation.chat import Chunk
from wire.sampling import sampling_of

log = logging.getLogger("parrot.responses")

NEXT = "parrot_next_input"  # the variable where the next turn's user message goes
PLACEHOLDER = {"role": "user", "content": "{{" + NEXT + "}}"}
_NOT_FORKED = ("tools", "response_format", "logprobs", "top_logprobs")


class Pinned(NamedTuple):
    engine_id: str
    context_id: str
    prefix: str  # the rendered conversation the context holds
    trim: bool = False  # a kept turn's context: it may hold more than the prefix, which the next fork trims off


class Kept(NamedTuple):
    """A forked turn's own context, kept on the engine until its response is pinned (or not)."""

    engine_id: str
    context_id: str
    since: float


class ForkTarget(NamedTuple):
    """A next turn's fork: the pinned conversation, its engine, the turn's sampling and what follows the context."""

    pinned: Pinned
    engine: ContextEngine
    record: Any  # the engine's registry record (in-flight and request counts)
    sampling: dict[str, Any]
    fork_with: str


def _probe(chat: dict[str, Any], messages: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat body with the next user message as the variable the engine cuts the prompt at."""
    body = {k: v for k, v in chat.items() if k not in ("stream", "stream_options")}
    body["messages"] = [*messages, PLACEHOLDER]
    return body


def _new_context_id() -> str:
    return f"resp-{uuid.uuid4().hex}"


def forkable(chat: dict[str, Any]) -> bool:
    return not any(chat.get(k) for k in _NOT_FORKED) and (chat.get("n") or 1) == 1


def new_user_text(chat: dict[str, Any]) -> str | None:
    """The next turn's new user message as text, when that is all its input is (else None: not forked)."""
    last = chat["messages"][-1]
    if last.get("role") != "user":
        return None
    content = last.get("content")
    if isinstance(content, str):
        return content
    if isinstance(content, list) and all(p.get("type") == "text" for p in content):
        return "".join(p.get("text") or "" for p in content)
    return None


class ConversationContexts:
    def __init__(self, gateway: Gateway, config: ResponsesConfig, clock=time.monotonic):
        self.gateway = gateway
        self.config = config
        self._clock = clock
        self._pinned: OrderedDict[str, tuple[Pinned, float]] = OrderedDict()  # response id -> pin, last used
        self._pending: dict[str, asyncio.Task] = {}
        self._kept: dict[str, Kept] = {}  # response id -> its fork's context, until pinned (or released)
        self.forks = 0  # turns run as a fork of a pinned conversation

    def _engine(self, engine_id: str) -> ContextEngine | None:
        record = self.gateway.registry.get(engine_id)
        if record is None or not has_capability(record.engine, ContextEngine):
            return None
        return record.engine  # type: ignore[return-value]

    def pin_later(self, response_id: str, engine_id: str, chat: dict[str, Any],
                  answer: list[dict[str, Any]]) -> None:
        """After a stored turn ran on ``engine_id``: pins its conversation (``chat``'s messages and the
        ``answer``'s) in a context there, in a task a next turn waits for: the turn's own context when it
        was a fork that kept it (the next fork trims it to the next prompt's start), else one filled with it."""
        kept = self._kept.pop(response_id, None)
        if kept is not None and kept.engine_id != engine_id:
            self._free_kept(kept)
            kept = None
        if not self.config.pin_contexts or not forkable(chat) or self._engine(engine_id) is None:
            if kept is not None:
                self._free_kept(kept)
            return
        task = asyncio.create_task(self._pin(response_id, engine_id, chat, answer, kept))
        self._pending[response_id] = task
        task.add_done_callback(lambda _: self._pending.pop(response_id, None))

    async def _pin(self, response_id: str, engine_id: str, chat: dict[str, Any], answer: list[dict[str, Any]],
                   kept: Kept | None) -> None:
        engine = self._engine(engine_id)
        if engine is None:
            return
        context_id = kept.context_id if kept is not None else _new_context_id()
        try:
            split = await engine.split_prompt("chat/completions", _probe(chat, [*chat["messages"], *answer]))
            if not split.prefix:
                raise EngineError("no place to cut the conversation for its next turn")
            if kept is None:  # a kept one: nothing computed; the next fork trims it and computes what follows
                await engine.fill(text=split.prefix, context_id=context_id)
        except asyncio.CancelledError:  # released meanwhile: whatever the engine holds for it is freed
            asyncio.get_running_loop().create_task(self._free(engine, context_id))
            raise
        except EngineError as exc:
            log.info("pinning the conversation of %s failed: %s", response_id, exc)
            if kept is not None:
                self._free_kept(kept)
            return
        self._pinned[response_id] = (Pinned(engine_id, context_id, split.prefix, trim=kept is not None), self._clock())
        while len(self._pinned) > self.config.max_pinned_contexts:
            oldest = next(iter(self._pinned))
            self.release(oldest)

    async def pinned(self, response_id: str) -> Pinned | None:
        task = self._pending.get(response_id)
        if task is not None:
            await asyncio.wait([task])
        found = self._pinned.get(response_id)
        if found is None:
            return None
        self._pinned[response_id] = (found[0], self._clock())
        self._pinned.move_to_end(response_id)
        return found[0]

    async def _fork_target(self, previous_id: str, chat: dict[str, Any]) -> ForkTarget | None:
        """Where the next turn (``chat``, whose last message is its new user message) forks the pinned
        conversation of ``previous_id``; None when it cannot (nothing pinned, another prompt start, tools...)."""
        text = new_user_text(chat)
        if text is None or not forkable(chat) or not self.config.pin_contexts:
            return None
        pinned = await self.pinned(previous_id)
        if pinned is None:
            return None
        engine = self._engine(pinned.engine_id)
        record = self.gateway.registry.get(pinned.engine_id)
        if engine is None or record is None or record not in self.gateway.engines_for(chat["model"]):
            return None
        try:
            split: PromptSplit = await engine.split_prompt("chat/completions", _probe(chat, chat["messages"][:-1]))
        except EngineError:
            return None
        if split.prefix != pinned.prefix:
            return None  # other instructions or history than the pinned ones: not the same prompt
        sampling = sampling_of(chat) | self.gateway.token_defaults("chat/completions", chat, record.engine)
        return ForkTarget(pinned, engine, record, sampling, split.rest_with({NEXT: text}))

    def _forked(self, previous_id: str, target: ForkTarget, exc: EngineError) -> None:
        log.info("forking the conversation of %s failed: %s", previous_id, exc)
        self._pinned.pop(previous_id, None)  # the context is gone (the engine restarted)

    def _count(self, model: str, target: ForkTarget, generation: Generation) -> dict[str, Any]:
        """A fork's chat usage, counted as the chat path counts a request's (forks, the key's token quota)."""
        self.forks += 1
        self.gateway.outcomes.forked(model, target.record.engine.name)
        prompt, cached = generation.prompt_usage()
        completion = generation.usage.get("completion_tokens", len(generation.token_ids))
        count_tokens(prompt + completion)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def _kept_by(self, keep_for: str | None, target: ForkTarget, context_id: str | None,
                 finish_reason: str | None) -> None:
        """Remembers the fork's context the engine kept (it keeps one that finished) for its response."""
        if keep_for is not None and context_id is not None and finish_reason in ("stop", "length"):
            self._kept[keep_for] = Kept(target.pinned.engine_id, context_id, self._clock())

    async def _start_fork(self, previous_id: str, chat: dict[str, Any], keep_for: str | None
                          ) -> tuple[ForkTarget, str | None] | None:
        """The engine and pinned context a turn forks (counted in flight from here), and the id its context is kept
        under when the turn will be stored; None when the turn cannot fork."""
        target = await self._fork_target(previous_id, chat)
        if target is None:
            return None
        target.record.in_flight += 1
        target.record.requests.add()
        return target, None if keep_for is None else _new_context_id()

    async def fork(self, previous_id: str, chat: dict[str, Any], keep_for: str | None = None
                   ) -> tuple[bytes, str] | None:
        """The next turn run as a fork of the pinned conversation of ``previous_id``: a chat completion body
        and the engine's id; None when it cannot be: the turn then runs as usual. ``keep_for``: the id of the
        turn's response, when it will be stored: the fork's context is kept for its pin (``pin_later``)."""
        started = await self._start_fork(previous_id, chat, keep_for)
        if started is None:
            return None
        target, keep_as = started
        try:
            generation = await target.engine.generate_in_context(
                target.pinned.context_id, target.sampling, fork_with=target.fork_with,
                context_text=target.pinned.prefix, keep_as=keep_as, trim=target.pinned.trim)
        except EngineError as exc:
            self._forked(previous_id, target, exc)
            return None
        finally:
            target.record.in_flight -= 1
        self._kept_by(keep_for, target, keep_as, generation.finish_reason)
        used = self._count(chat["model"], target, generation)
        body = {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
                "model": chat["model"],
                "choices": [{"index": 0, "message": {"role": "assistant", "content": generation.text},
                             "finish_reason": generation.finish_reason or "stop"}],
                "usage": used}
        return msgspec.json.encode(body), target.record.id

    async def fork_stream(self, previous_id: str, chat: dict[str, Any], keep_for: str | None = None
                          ) -> tuple[AsyncIterator[Chunk], str] | None:
        """The next turn streamed as a fork of the pinned conversation of ``previous_id``: its chat chunks
        (the usage in the last) and the engine's id, once the engine's stream has started; None when it cannot
        be (the turn then streams as usual). ``keep_for``: as ``fork``'s."""
        started = await self._start_fork(previous_id, chat, keep_for)
        if started is None:
            return None
        target, keep_as = started
        generated = target.engine.stream_in_context(target.pinned.context_id, target.sampling,
                                                    fork_with=target.fork_with, context_text=target.pinned.prefix,
                                                    keep_as=keep_as, trim=target.pinned.trim)
        try:
            first = await anext(generated)
        except (EngineError, StopAsyncIteration) as exc:
            target.record.in_flight -= 1
            await generated.aclose()
            self._forked(previous_id, target, exc if isinstance(exc, EngineError) else EngineError("no output"))
            return None
        chunks = self._fork_chunks(chat["model"], target, first, generated, lambda finish_reason: self._kept_by(
            keep_for, target, keep_as, finish_reason))
        return chunks, target.record.id

    async def _fork_chunks(self, model: str, target: ForkTarget, first: GenerationChunk,
                           generated: AsyncIterator[GenerationChunk],
                           finished: Callable[[str], None]) -> AsyncIterator[Chunk]:
        """The engine's generation chunks as chat chunks; an engine failure mid-stream is the chunk's error."""
        token_ids: list[int] = []
        try:
            step: GenerationChunk | None = first
            while step is not None:
                token_ids += step.token_ids
                used = None
                if step.finish_reason is not None:  # the last: the whole generation's usage
                    finished(step.finish_reason)
                    used = self._count(model, target, Generation(
                        "", token_ids, step.finish_reason, step.usage or {}, step.context_tokens or 0))
                yield msgspec.convert({"choices": [{"index": 0, "delta": {"content": step.text},
                                                    "finish_reason": step.finish_reason}], "usage": used}, Chunk)
                step = await anext(generated, None)
        except EngineError as exc:
            self.gateway.outcomes.failed(model, exc)
            yield Chunk(error=engine_error_body(exc))
        finally:
            target.record.in_flight -= 1
            await generated.aclose()

    def release(self, response_id: str) -> None:
        """Frees the context of ``response_id`` (deleted, forgotten, idle or evicted), in the background."""
        task = self._pending.pop(response_id, None)
        if task is not None:
            task.cancel()
        kept = self._kept.pop(response_id, None)
        if kept is not None:
            self._free_kept(kept)
        found = self._pinned.pop(response_id, None)
        if found is None:
            return
        engine = self._engine(found[0].engine_id)
        if engine is not None:
            asyncio.get_running_loop().create_task(self._free(engine, found[0].context_id))

    def _free_kept(self, kept: Kept) -> None:
        engine = self._engine(kept.engine_id)
        if engine is not None:
            asyncio.get_running_loop().create_task(self._free(engine, kept.context_id))

    @staticmethod
    async def _free(engine: ContextEngine, context_id: str) -> None:
        try:
            await engine.free_context(context_id)
        except EngineError:
            pass  # the engine is gone, or restarted: the context with it

    def sweep(self) -> None:
        """Frees the contexts unused for ``context_idle_ttl_s``."""
        deadline = self._clock() - self.config.context_idle_ttl_s
        for response_id in [r for r, (_, used) in self._pinned.items() if used < deadline]:
            self.release(response_id)
        for response_id in [r for r, kept in self._kept.items() if kept.since < deadline]:  # never pinned
            self.release(response_id)

    def __len__(self) -> int:
        return len(self._pinned)
