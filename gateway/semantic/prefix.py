"""Shared constant prefixes pinned as contexts on builtin engines, so requests fork instead of recompute.

A prefix is the constant text of a rendered prompt before its first variable (a system prompt,
few-shot examples, a shared document). The first request that needs one fills it on an engine;
concurrent requests wait for that fill rather than racing it; later requests fork from it and are
routed to the engine that holds it. Sessions pin the prefixes they used; deleting the last session
that pinned one frees its context. Unpinned prefixes beyond ``max_per_engine`` are evicted LRU.
"""

from __future__ import annotations

import asyncio
import hashlib
import time

from engines.contexts import ContextClient


class PrefixEntry:
    def __init__(self, key: str, engine_id: str, client: ContextClient):
        self.key = key
        self.engine_id = engine_id
        self.client = client
        self.filled: asyncio.Future[str] = asyncio.get_running_loop().create_future()  # the context id
        self.sessions: set[str] = set()
        self.in_use = 0
        self.last_used = time.monotonic()
        self.hits = 0
        self.tokens = 0


class PrefixCache:
    def __init__(self, max_per_engine: int = 32):
        self.max_per_engine = max_per_engine
        self._entries: dict[str, PrefixEntry] = {}
        self.hit_tokens = 0  # prompt tokens forked from a pinned prefix instead of recomputed

    @staticmethod
    def key(engine_id: str, text: str) -> str:
        return hashlib.sha256(f"{engine_id}\0{text}".encode()).hexdigest()

    def engine_holding(self, texts: list[tuple[str, str]]) -> str | None:
        """Of candidate (engine_id, prefix) pairs, the engine that already holds its prefix, if any."""
        for engine_id, text in texts:
            entry = self._entries.get(self.key(engine_id, text))
            if entry is not None and entry.filled.done() and not entry.filled.exception():
                return engine_id
        return None

    async def acquire(self, engine_id: str, client: ContextClient, text: str, pin: str | None) -> PrefixEntry:
        """The prefix's context on that engine, filled now if nobody has; pinned for session ``pin``.
        The caller must ``release`` it when its request is done."""
        key = self.key(engine_id, text)
        entry = self._entries.get(key)
        if entry is None:
            entry = self._entries[key] = PrefixEntry(key, engine_id, client)
            entry.in_use += 1
            try:
                result = await client.fill(text=text)
            except BaseException as exc:
                del self._entries[key]
                entry.filled.set_exception(exc)
                entry.filled.exception()  # retrieved: waiters re-raise it themselves
                raise
            entry.tokens = result.num_tokens
            entry.filled.set_result(result.context_id)
            await self._evict(engine_id)
        else:
            entry.in_use += 1
            try:
                await asyncio.shield(entry.filled)
            except BaseException:
                entry.in_use -= 1
                raise
            entry.hits += 1
            self.hit_tokens += entry.tokens
        if pin is not None:
            entry.sessions.add(pin)
        entry.last_used = time.monotonic()
        return entry

    @staticmethod
    def release(entry: PrefixEntry) -> None:
        entry.in_use -= 1
        entry.last_used = time.monotonic()

    async def drop_session(self, session_id: str, keys: set[str]) -> int:
        """Unpin a deleted session's prefixes; free those nobody else pins. Returns contexts freed."""
        freed = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.sessions.discard(session_id)
            if not entry.sessions and entry.in_use == 0:
                freed += await self._free(entry)
        return freed

    async def _evict(self, engine_id: str) -> None:
        mine = [e for e in self._entries.values() if e.engine_id == engine_id and e.filled.done()]
        idle = sorted((e for e in mine if e.in_use == 0 and not e.sessions), key=lambda e: e.last_used)
        for entry in idle[: max(0, len(mine) - self.max_per_engine)]:
            await self._free(entry)

    async def _free(self, entry: PrefixEntry) -> int:
        self._entries.pop(entry.key, None)
        if entry.filled.done() and not entry.filled.exception():
            try:
                await entry.client.free(entry.filled.result())
            except Exception:  # the engine may be gone; its contexts went with it
                return 0
        return 1

    def forget_engine(self, engine_id: str) -> None:
        for key in [k for k, e in self._entries.items() if e.engine_id == engine_id]:
            del self._entries[key]
