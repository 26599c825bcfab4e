"""gateway/responses/contexts.py without an engine process: a stub engine with contexts records what is filled,
forked and freed; the pins' bounds (count, idle TTL) and their release when a response is deleted."""

from __future__ import annotations

import asyncio
from typing import Any

import httpx

from engines.seam import EngineStats, Generation, PromptSplit, Segment
from engines.seam.contexts import GenerationChunk
from gateway.config import GatewayConfig, ResponsesConfig
from gateway.metrics import GatewayMetrics
from gateway.registry import EngineRegistry
from gateway.responses.contexts import NEXT, ConversationContexts
from gateway.responses.store import ResponseStore, StoredResponse
from gateway.service import Gateway
from wire.responses import MessageItem, Response


class StubContextEngine:
    name = "stub"

    def __init__(self):
        self.filled: dict[str, str] = {}
        self.freed: list[str] = []
        self.forked: list[tuple[str, str]] = []
        self.kept: dict[str, str] = {}  # context id -> the text a fork trimmed it to

    async def create(self, route, body): raise AssertionError("not the plain path")
    def stream(self, route, body): raise AssertionError("not the plain path")
    async def health(self) -> bool: return True
    async def stats(self) -> EngineStats: return EngineStats()
    async def aclose(self) -> None: pass

    async def split_prompt(self, route, body: dict[str, Any]) -> PromptSplit:
        rendered = "".join(f"<{m['role']}>{m['content']}</>" for m in body["messages"][:-1])
        return PromptSplit(prefix=rendered + "<user>", rest=[Segment(variable=NEXT), Segment(text="</><assistant>")])

    async def fill(self, *, text=None, tokens=None, parent_context_id=None, context_id=None, if_absent=False):
        self.filled[context_id] = text

    async def generate_in_context(self, context_id, sampling, *, fork_with=None, context_text=None, output_id=None,
                                  keep_as=None, trim=False):
        self._forking(context_id, fork_with, context_text, trim)
        if keep_as is not None:
            self.kept[keep_as] = ""
        return Generation(text="answer", token_ids=[1], finish_reason="stop",
                          usage={"prompt_tokens": 3, "completion_tokens": 1}, context_tokens=10)

    async def stream_in_context(self, context_id, sampling, *, fork_with=None, context_text=None, output_id=None,
                                keep_as=None, trim=False):
        self._forking(context_id, fork_with, context_text, trim)
        if keep_as is not None:
            self.kept[keep_as] = ""
        yield GenerationChunk(text="ans", token_ids=[1])
        yield GenerationChunk(text="wer", token_ids=[2], finish_reason="stop",
                              usage={"prompt_tokens": 3, "completion_tokens": 2}, context_tokens=10)

    def _forking(self, context_id, fork_with, context_text, trim):
        self.forked.append((context_id, fork_with))
        if trim:  # the engine trims the context to the text, then forks it
            self.kept[context_id] = context_text

    async def free_context(self, context_id: str) -> int:
        self.freed.append(context_id)
        return 1


CHAT = {"model": "m", "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "q1"}]}
ANSWER = [{"role": "assistant", "content": "a1"}]
NEXT_CHAT = {"model": "m", "messages": [*CHAT["messages"], *ANSWER, {"role": "user", "content": "q2"}]}


def _setup(**config):
    registry = EngineRegistry()
    engine = StubContextEngine()
    record = registry.add(engine, ["m"])
    gateway = Gateway(GatewayConfig(), registry, GatewayMetrics(), httpx.AsyncClient())
    now = [0.0]
    contexts = ConversationContexts(gateway, ResponsesConfig(**config), clock=lambda: now[0])
    return engine, record, contexts, now


def test_a_next_turn_forks_the_pinned_conversation_and_a_changed_one_does_not():
    async def run():
        engine, record, contexts, _ = _setup()
        contexts.pin_later("resp_1", record.id, CHAT, ANSWER)
        body, engine_id = await contexts.fork("resp_1", NEXT_CHAT)
        assert engine_id == record.id
        [(context_id, text)] = engine.forked
        assert engine.filled[context_id] == "<system>be brief</><user>q1</><assistant>a1</><user>"
        assert text == "q2</><assistant>"
        assert b'"cached_tokens":10' in body and b'"prompt_tokens":13' in body
        other = {**NEXT_CHAT, "messages": [{"role": "system", "content": "other"}, *NEXT_CHAT["messages"][1:]]}
        assert await contexts.fork("resp_1", other) is None  # another prompt start: the plain path
        assert await contexts.fork("resp_1", {**NEXT_CHAT, "tools": [{"type": "function"}]}) is None
        assert await contexts.fork("resp_unknown", NEXT_CHAT) is None

    asyncio.run(run())


def test_pins_are_bounded_idle_ones_freed_and_deleted_ones_released():
    async def run():
        engine, record, contexts, now = _setup(max_pinned_contexts=2, context_idle_ttl_s=60)
        for i in range(3):
            contexts.pin_later(f"resp_{i}", record.id, CHAT, ANSWER)
            await contexts.pinned(f"resp_{i}")
        await asyncio.sleep(0)
        assert len(contexts) == 2 and len(engine.freed) == 1  # the least recently used went
        store = ResponseStore(ResponsesConfig())
        store.on_drop = contexts.release  # as ResponsesService wires them
        stored = StoredResponse(Response(model="m", id="resp_1"), [MessageItem(role="user", content="q1")], [])
        store.put("owner", stored)
        store.delete("owner", "resp_1")
        await asyncio.sleep(0)
        assert len(contexts) == 1 and len(engine.freed) == 2
        now[0] = 61.0
        contexts.sweep()
        await asyncio.sleep(0)
        assert len(contexts) == 0 and len(engine.freed) == 3

    asyncio.run(run())


def test_a_streamed_turn_pins_too():
    async def run():
        engine, record, contexts, _ = _setup()
        streamed = {**CHAT, "stream": True, "stream_options": {"include_usage": True}}
        contexts.pin_later("resp_s", record.id, streamed, ANSWER)
        assert await contexts.pinned("resp_s") is not None

    asyncio.run(run())


def test_a_streamed_next_turn_forks_the_pinned_conversation_chunk_by_chunk():
    async def run():
        engine, record, contexts, _ = _setup()
        contexts.pin_later("resp_1", record.id, CHAT, ANSWER)
        streamed = {**NEXT_CHAT, "stream": True, "stream_options": {"include_usage": True}}
        chunks, engine_id = await contexts.fork_stream("resp_1", streamed)
        assert engine_id == record.id and record.in_flight == 1  # the engine's stream has started
        got = [chunk async for chunk in chunks]
        assert "".join(c.choices[0].delta.content for c in got) == "answer"
        assert got[-1].choices[0].finish_reason == "stop"
        assert got[-1].usage.prompt_tokens == 13 and got[-1].usage.prompt_tokens_details.cached_tokens == 10
        assert record.in_flight == 0 and contexts.forks == 1
        [(_, text)] = engine.forked
        assert text == "q2</><assistant>"
        assert await contexts.fork_stream("resp_unknown", streamed) is None

    asyncio.run(run())


NEXT_ANSWER = [{"role": "assistant", "content": "answer"}]
THIRD_CHAT = {"model": "m", "messages": [*NEXT_CHAT["messages"], *NEXT_ANSWER, {"role": "user", "content": "q3"}]}


def test_a_forked_turn_is_pinned_as_its_own_context_trimmed_not_filled_again():
    async def run():
        engine, record, contexts, _ = _setup()
        contexts.pin_later("resp_1", record.id, CHAT, ANSWER)
        chunks, _ = await contexts.fork_stream("resp_1", {**NEXT_CHAT, "stream": True}, keep_for="resp_2")
        [_ async for _ in chunks]
        [kept] = engine.kept
        contexts.pin_later("resp_2", record.id, NEXT_CHAT, NEXT_ANSWER)
        pinned = await contexts.pinned("resp_2")
        assert pinned.context_id == kept and kept not in engine.filled and pinned.trim  # not filled again
        assert pinned.prefix == "<system>be brief</><user>q1</><assistant>a1</><user>q2</><assistant>answer</><user>"
        await contexts.fork("resp_2", THIRD_CHAT)
        assert engine.forked[-1] == (kept, "q3</><assistant>")
        assert engine.kept[kept] == pinned.prefix  # trimmed by the fork, to where the next prompt goes on
        # a kept context its response never pins (not stored after all, failed) is freed with it, or when idle
        chunks, _ = await contexts.fork_stream("resp_2", {**THIRD_CHAT, "stream": True}, keep_for="resp_3")
        [_ async for _ in chunks]
        contexts.release("resp_3")
        await asyncio.sleep(0)
        assert engine.freed[-1] == list(engine.kept)[-1]

    asyncio.run(run())


def test_a_kept_context_never_pinned_is_freed_when_idle():
    async def run():
        engine, record, contexts, now = _setup(context_idle_ttl_s=60)
        contexts.pin_later("resp_1", record.id, CHAT, ANSWER)
        await contexts.fork("resp_1", NEXT_CHAT, keep_for="resp_2")
        [kept] = engine.kept
        now[0] = 61.0
        contexts.sweep()
        await asyncio.sleep(0)
        assert kept in engine.freed

    asyncio.run(run())
