"""The state seam in this process's memory: for tests and benchmarks, and the counters of a store that only
one process uses (sqlite.py's). Nothing survives the process; TTLs are enforced when a record is read."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Callable

from gateway.state.store import Listener


class MemoryStore:
    kind = "memory"
    shared = False
    durable = False

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._records: dict[str, dict[str, bytes]] = {}
        self._expiry: dict[str, float] = {}  # key -> when it expires (only records with a TTL)
        self._buckets: dict[str, list[float]] = {}  # key -> [level, updated, capacity, per_s]
        self._seats: dict[str, list[float]] = {}  # key -> [count, expires]
        self._sets: dict[str, OrderedDict[str, tuple[int, float]]] = {}  # key -> member -> (size, counted at), oldest first
        self._listeners: dict[str, list[Listener]] = {}

    async def start(self) -> None:
        pass

    async def aclose(self) -> None:
        pass

    async def ping(self) -> float:
        return 0.0

    # ---------------------------------------------------------------- records

    def _live(self, key: str) -> dict[str, bytes] | None:
        expires = self._expiry.get(key)
        if expires is not None and expires <= self._clock():
            self._records.pop(key, None)
            del self._expiry[key]
        return self._records.get(key)

    async def read(self, key: str) -> dict[str, bytes]:
        record = self._live(key)
        return dict(record) if record else {}

    async def read_field(self, key: str, field: str) -> bytes | None:
        record = self._live(key)
        return record.get(field) if record else None

    def _write(self, key: str, fields: dict[str, bytes], ttl_s: float | None) -> dict[str, bytes]:
        record = self._live(key)
        if record is None:
            record = self._records[key] = {}
        record.update(fields)
        if ttl_s is not None:
            self._expiry[key] = self._clock() + ttl_s
        return record

    async def write(self, key: str, fields: dict[str, bytes], ttl_s: float | None = None) -> None:
        self._write(key, fields, ttl_s)

    async def write_new(self, key: str, field: str, value: bytes, ttl_s: float | None = None) -> bytes:
        record = self._live(key) or {}
        if field in record:
            return record[field]
        self._write(key, {field: value}, ttl_s)
        return value

    async def remove_fields(self, key: str, fields: list[str]) -> None:
        record = self._live(key)
        if record is not None:
            for field in fields:
                record.pop(field, None)
            if not record:
                self._records.pop(key, None)
                self._expiry.pop(key, None)

    async def remove(self, keys: list[str]) -> None:
        for key in keys:
            self._records.pop(key, None)
            self._expiry.pop(key, None)

    async def expire(self, key: str, ttl_s: float) -> None:
        if self._live(key) is not None:
            self._expiry[key] = self._clock() + ttl_s

    async def apply(self, ops: list[tuple]) -> None:
        await apply_one_by_one(self, ops)

    async def lease(self, key: str, holder: str, ttl_s: float) -> bool:
        record = self._live(key)
        if record and record.get("holder", holder.encode()) != holder.encode():
            return False
        self._write(key, {"holder": holder.encode()}, ttl_s)
        return True

    # ---------------------------------------------------------------- counters

    def take_now(self, key: str, capacity: float, per_s: float, cost: float, need: float) -> tuple[bool, float]:
        """``take`` without awaiting (the quotas' fast path when the store is this one)."""
        now = self._clock()
        bucket = self._buckets.get(key)
        if bucket is None:
            bucket = self._buckets[key] = [capacity, now, capacity, per_s]
        level = min(capacity, bucket[0] + (now - bucket[1]) * per_s)
        bucket[1] = now
        if level < need:
            bucket[0] = level
            return False, level
        bucket[0] = level - cost
        if bucket[0] >= capacity:  # full again: forgetting it changes nothing
            del self._buckets[key]
        return True, level - cost

    async def take(self, key: str, capacity: float, per_s: float, cost: float, need: float) -> tuple[bool, float]:
        return self.take_now(key, capacity, per_s, cost, need)

    def seat_now(self, key: str, limit: int | None, ttl_s: float) -> bool:
        now = self._clock()
        seat = self._seats.get(key)
        if seat is None or seat[1] <= now:
            seat = self._seats[key] = [0, 0.0]
        if limit is not None and seat[0] >= limit:
            return False
        seat[0] += 1
        seat[1] = now + ttl_s
        return True

    async def seat(self, key: str, limit: int | None, ttl_s: float) -> bool:
        return self.seat_now(key, limit, ttl_s)

    def unseat_now(self, key: str) -> None:
        seat = self._seats.get(key)
        if seat is not None:
            seat[0] -= 1
            if seat[0] <= 0:
                del self._seats[key]

    async def unseat(self, key: str) -> None:
        self.unseat_now(key)

    def forget_full(self) -> int:
        """Drops buckets that are full again and seats no longer held; returns how many (many keys pass through)."""
        now = self._clock()
        full = [key for key, (level, updated, capacity, per_s) in self._buckets.items()
                if level + (now - updated) * per_s >= capacity]
        for key in full:
            del self._buckets[key]
        gone = [key for key, (count, expires) in self._seats.items() if count <= 0 or expires <= now]
        for key in gone:
            del self._seats[key]
        expired = [key for key, expires in self._expiry.items() if expires <= now]
        for key in expired:
            self._records.pop(key, None)
            del self._expiry[key]
        return len(full) + len(gone) + len(expired)

    # ---------------------------------------------------------------- bounded sets

    def keep_now(self, key: str, member: str, size: int, max_count: int, max_bytes: int, ttl_s: float) -> list[str]:
        now = self._clock()
        members = self._sets.setdefault(key, OrderedDict())
        for old in [m for m, (_, at) in members.items() if at <= now - ttl_s]:
            del members[old]
        members.pop(member, None)
        members[member] = (size, now)
        total = sum(s for s, _ in members.values())
        dropped = []
        while len(members) > max_count or total > max_bytes:
            oldest = next(iter(members))
            if oldest == member:
                break
            total -= members.pop(oldest)[0]
            dropped.append(oldest)
        return dropped

    async def keep(self, key: str, member: str, size: int, max_count: int, max_bytes: int,
                   ttl_s: float) -> list[str]:
        return self.keep_now(key, member, size, max_count, max_bytes, ttl_s)

    def forget_now(self, key: str, members: list[str]) -> None:
        kept = self._sets.get(key)
        if kept is not None:
            for member in members:
                kept.pop(member, None)
            if not kept:
                del self._sets[key]

    async def forget(self, key: str, members: list[str]) -> None:
        self.forget_now(key, members)

    # ---------------------------------------------------------------- wake-ups

    async def publish(self, channel: str, message: bytes) -> None:
        loop = asyncio.get_running_loop()
        for listener in self._listeners.get(channel, ()):
            loop.call_soon(listener, message)  # later, as a message through a server arrives

    def subscribe(self, channel: str, listener: Listener) -> None:
        self._listeners.setdefault(channel, []).append(listener)


async def apply_one_by_one(store, ops: list[tuple]) -> None:
    """``StateStore.apply`` as the single operations, in order."""
    for op in ops:
        kind = op[0]
        if kind == "write":
            await store.write(op[1], op[2], ttl_s=op[3])
        elif kind == "remove_fields":
            await store.remove_fields(op[1], op[2])
        elif kind == "remove":
            await store.remove(op[1])
        elif kind == "expire":
            await store.expire(op[1], op[2])
        elif kind == "publish":
            await store.publish(op[1], op[2])
        elif kind == "remove_if":
            if await store.read_field(op[1], op[2]) == op[3]:
                await store.remove([op[1]])
        else:
            raise ValueError(f"unknown state operation {kind!r}")
