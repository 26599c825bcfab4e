"""Shared constant prefixes pinned as contexts on builtin engines, so requests fork instead of recompute.

A prefix is the constant text of a rendered prompt before its first variable (a system prompt,
few-shot examples, a shared document). Its context id is chosen here; every request that uses it
sends the prefix's text along, and the engine creates the context from the first one to arrive.
So nobody waits for a fill: the engine computes the prefix once, in the step where the first of
them is scheduled, and shares its KV with the rest. Requests are routed to the engine that holds
a prefix.

Retention follows the DAG: a prefix in use, or reserved by a call still waiting for its inputs (the
runner fills it ahead and holds it until the call ends), is never evicted. Sessions pin the prefixes
they used; deleting the last session that pinned one frees its context (once its last request ends,
if some still use it). Beyond ``max_per_engine`` prefixes on an engine, idle ones are evicted in the
order nobody is likely to use them again: first those no session pins (one-off requests), then
those only sessions pin, each group least recently used first.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
import uuid

from engines.seam import ContextEngine


class PrefixEntry:
    def __init__(self, key: str, engine_id: str, engine: ContextEngine):
        self.key = key
        self.engine_id = engine_id
        self.engine = engine
        self.context_id = uuid.uuid4().hex
        self.sessions: set[str] = set()
        self.in_use = 0
        self.last_used = time.monotonic()
        self.free_when_idle = False  # its last pinning session was deleted while requests still used it


class PrefixCache:
    def __init__(self, max_per_engine: int = 32):
        self.max_per_engine = max_per_engine
        self._entries: dict[str, PrefixEntry] = {}
        self.hit_tokens = 0  # prompt tokens forked from a pinned prefix instead of recomputed
        self._freeing: set[asyncio.Task] = set()  # frees started by release_soon (held so they finish)

    @staticmethod
    def key(engine_id: str, text: str) -> str:
        return hashlib.sha256(f"{engine_id}\0{text}".encode()).hexdigest()

    def holds(self, engine_id: str, text: str) -> bool:
        """Whether a request pinned this prefix on that engine (it holds the context unless every request
        on it failed; the next one creates it then)."""
        return self.key(engine_id, text) in self._entries

    async def acquire(self, engine_id: str, engine: ContextEngine, text: str, pin: str | None
                      ) -> tuple[PrefixEntry, bool]:
        """The prefix's entry for that engine, pinned for session ``pin``, and whether it is a hit (an
        earlier request named it). The caller must ``release`` it when its request is done."""
        key = self.key(engine_id, text)
        entry = self._entries.get(key)
        hit = entry is not None
        if entry is None:
            entry = self._entries[key] = PrefixEntry(key, engine_id, engine)
        entry.in_use += 1
        pinned = pin is not None and pin not in entry.sessions
        if pinned:
            entry.sessions.add(pin)
        entry.last_used = time.monotonic()
        if not hit:
            try:
                await self._evict(engine_id)
            except BaseException:  # cancelled (its session deleted, say): the caller never gets to release it
                entry.in_use -= 1
                if pinned:
                    entry.sessions.discard(pin)
                raise
        return entry, hit

    async def release(self, entry: PrefixEntry) -> None:
        if self._released(entry):
            await self._free(entry)

    def release_soon(self, entry: PrefixEntry) -> None:
        """``release`` from a done-callback: a context to free is freed by a task of its own."""
        if self._released(entry):
            task = asyncio.ensure_future(self._free(entry))
            self._freeing.add(task)
            task.add_done_callback(self._freeing.discard)

    def _released(self, entry: PrefixEntry) -> bool:
        """One use of ``entry`` ended; whether its context is now to be freed."""
        entry.in_use -= 1
        entry.last_used = time.monotonic()
        return entry.in_use == 0 and entry.free_when_idle and not entry.sessions

    async def drop_session(self, session_id: str, keys: set[str]) -> int:
        """Unpin a deleted session's prefixes; free those nobody else pins. Returns contexts freed."""
        freed = 0
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            entry.sessions.discard(session_id)
            if entry.sessions:
                continue
            if entry.in_use == 0:
                freed += await self._free(entry)
            else:
                entry.free_when_idle = True
        return freed

    async def _evict(self, engine_id: str) -> None:
        mine = [e for e in self._entries.values() if e.engine_id == engine_id]
        idle = sorted((e for e in mine if e.in_use == 0), key=lambda e: (bool(e.sessions), e.last_used))
        for entry in idle[: max(0, len(mine) - self.max_per_engine)]:
            await self._free(entry)

    async def _free(self, entry: PrefixEntry) -> int:
        self._entries.pop(entry.key, None)
        try:
            await entry.engine.free_context(entry.context_id)
        except Exception:  # never created (its requests failed), or the engine is gone with its contexts
            # A request cancelled here but still on its way to the engine may create the context again
            # after this; it is then unpinned, as after a gateway restart (the engine's LRU evicts its KV).
            return 0
        return 1

    def contexts_on(self, engine_id: str) -> int:
        """The shared-prefix contexts this gateway holds on that engine."""
        return sum(1 for entry in self._entries.values() if entry.engine_id == engine_id)

    def forget_engine(self, engine_id: str) -> None:
        for key in [k for k, e in self._entries.items() if e.engine_id == engine_id]:
            del self._entries[key]
