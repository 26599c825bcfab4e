"""The gateway's table of shared prefixes pinned on engines: who pins what, and when a context is freed.

The engine is reached through its context capability (engines/seam ``ContextEngine``); here a recording
stand-in takes its one call that matters (``free_context``). The real client against a real engine is exercised in test_semantic_engine.py."""

from __future__ import annotations

import asyncio

import pytest

from gateway.semantic.prefix import PrefixCache


class RecordingContexts:
    def __init__(self) -> None:
        self.freed: list[str] = []

    async def free_context(self, context_id: str) -> None:
        self.freed.append(context_id)


async def test_a_prefix_dropped_while_in_use_is_freed_once_by_its_last_release():
    cache, engine = PrefixCache(), RecordingContexts()
    pinned, _ = await cache.acquire("e1", engine, "You are a helpful assistant.", pin="sess_a")
    shared, hit = await cache.acquire("e1", engine, "You are a helpful assistant.", pin=None)  # a default session
    assert hit and shared is pinned

    assert await cache.drop_session("sess_a", {pinned.key}) == 0  # still in use: not yet
    await cache.release(pinned)
    assert engine.freed == []
    await cache.release(shared)

    assert engine.freed == [pinned.context_id]
    assert not cache.holds("e1", "You are a helpful assistant.")


async def test_a_prefix_another_session_pins_outlives_one_sessions_deletion():
    cache, engine = PrefixCache(), RecordingContexts()
    first, _ = await cache.acquire("e1", engine, "Shared document.", pin="sess_a")
    await cache.acquire("e1", engine, "Shared document.", pin="sess_b")
    for _ in range(2):
        await cache.release(first)

    assert await cache.drop_session("sess_a", {first.key}) == 0
    assert engine.freed == []
    assert await cache.drop_session("sess_b", {first.key}) == 1
    assert engine.freed == [first.context_id]


async def test_an_acquire_cancelled_while_evicting_leaves_nothing_pinned():
    evicting = asyncio.Event()

    class StuckContexts(RecordingContexts):
        async def free_context(self, context_id: str) -> None:
            evicting.set()
            await asyncio.Event().wait()  # never freed: the acquire is cancelled in here

    cache, engine = PrefixCache(max_per_engine=1), StuckContexts()
    old, _ = await cache.acquire("e1", engine, "old prefix", pin=None)
    await cache.release(old)
    acquiring = asyncio.ensure_future(cache.acquire("e1", engine, "new prefix", pin="sess_a"))
    await asyncio.wait_for(evicting.wait(), 10)  # inside the eviction of the old prefix
    acquiring.cancel()
    with pytest.raises(asyncio.CancelledError):
        await acquiring

    entry = cache._entries[cache.key("e1", "new prefix")]
    assert entry.in_use == 0 and entry.sessions == set()


async def test_eviction_keeps_prefixes_in_use_and_frees_one_off_prefixes_before_session_pinned_ones():
    cache, engine = PrefixCache(max_per_engine=3), RecordingContexts()
    reserved, _ = await cache.acquire("e1", engine, "a prefix a waiting call will fork", pin=None)  # held
    pinned, _ = await cache.acquire("e1", engine, "a prefix its session may use again", pin="sess_a")
    await cache.release(pinned)
    one_off, _ = await cache.acquire("e1", engine, "a prefix of one request", pin=None)
    await cache.release(one_off)
    assert engine.freed == [] and cache.holds("e1", "a prefix a waiting call will fork")

    await cache.acquire("e1", engine, "the newest prefix", pin=None)  # over by one
    assert engine.freed == [one_off.context_id]  # newer than the session's, but nobody will use it again
    await cache.acquire("e1", engine, "one more prefix", pin=None)  # over by one again
    assert engine.freed == [one_off.context_id, pinned.context_id]  # the only idle one left
    assert cache.holds("e1", "a prefix a waiting call will fork")  # in use: never evicted
    assert reserved.in_use == 1


async def test_release_soon_frees_a_dropped_prefix_from_a_done_callback():
    cache, engine = PrefixCache(), RecordingContexts()
    entry, _ = await cache.acquire("e1", engine, "Shared document.", pin="sess_a")
    await cache.drop_session("sess_a", {entry.key})  # in use: freed when its last use ends
    cache.release_soon(entry)
    await asyncio.wait_for(asyncio.gather(*cache._freeing), 10)
    assert engine.freed == [entry.context_id]
