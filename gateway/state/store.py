"""The state seam: what the gateway keeps beyond one request, as one small async interface.

Four things, each atomic on its own: records (a key holding fields, with a TTL on the whole record),
counters (token buckets and counted seats, for rate and concurrency quotas), bounded sets (a key's stored
responses, by count and bytes), and wake-ups (publish a short
message on a channel; every subscriber of every process sharing the store gets it). Implementations:
``memory.py`` (one process; tests and benchmarks), ``sqlite.py`` (the embedded default: one file, survives a
restart) and ``redis_store.py`` (Redis or Valkey: several gateway replicas share one).

A store that cannot be reached raises ``StoreUnavailable``, which the gateway answers as a 503.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Protocol

Listener = Callable[[bytes], None]

# A write among several applied in order in one round trip (``StateStore.apply``):
#   ("write", key, {field: value}, ttl_s | None)   ("remove_fields", key, [field, ...])   ("remove", [key, ...])
#   ("expire", key, ttl_s)   ("publish", channel, message)   ("remove_if", key, field, value): the record goes if
#   its field holds that value
Op = tuple


class StoreUnavailable(Exception):
    """The state store did not answer (down, unreachable, or slower than ``[state] timeout_s``): the gateway
    answers 503 with a retry-after (gateway/errors.py); nothing was acknowledged."""

    code = "state_unavailable"
    retry_after_s = 1

    def __init__(self, message: str = "the gateway's state store is unavailable; retry shortly") -> None:
        super().__init__(message)
        self.message = message


class StateStore(Protocol):
    kind: str  # "memory", "sqlite" or "redis": for /health/ready, metrics and logs
    # Other processes see the same state (gateway replicas): what a process holds in memory may be stale, and a
    # wake-up may come from elsewhere. False: this process is the only one using it.
    shared: bool
    durable: bool  # what was written survives this process

    async def start(self) -> None: ...
    async def aclose(self) -> None: ...
    async def ping(self) -> float:
        """Seconds one round trip took; StoreUnavailable when it fails."""

    # ---- records: a key holding fields (bytes); the TTL is the whole record's
    async def read(self, key: str) -> dict[str, bytes]:
        """Every field of the record (empty: no such record, or expired)."""

    async def read_field(self, key: str, field: str) -> bytes | None: ...

    async def write(self, key: str, fields: dict[str, bytes], ttl_s: float | None = None) -> None:
        """Sets these fields (others kept); ``ttl_s``: the record expires that long from now (None: keeps its TTL,
        or none)."""

    async def write_new(self, key: str, field: str, value: bytes, ttl_s: float | None = None) -> bytes:
        """Sets ``field`` only if the record has none; returns the field's value now (the one set, or the one there)."""

    async def remove_fields(self, key: str, fields: list[str]) -> None: ...
    async def remove(self, keys: list[str]) -> None: ...
    async def expire(self, key: str, ttl_s: float) -> None:
        """The record (if any) expires ``ttl_s`` from now."""

    async def apply(self, ops: list[Op]) -> None:
        """The writes ``ops`` (see ``Op``), in order, in one round trip; each is atomic, not the batch."""

    async def lease(self, key: str, holder: str, ttl_s: float) -> bool:
        """Takes or renews the lease ``key`` (a record whose field ``holder`` names who holds it) for ``holder``:
        True when it was free (never taken, released or expired) or ``holder``'s already, and is now ``holder``'s
        for ``ttl_s``; False while another holds it. Released with the op ("remove_if", key, "holder", holder)."""

    # ---- counters
    async def take(self, key: str, capacity: float, per_s: float, cost: float, need: float) -> tuple[bool, float]:
        """A token bucket holding up to ``capacity``, refilled at ``per_s`` a second (full when new): when it holds at
        least ``need``, takes ``cost`` (it may go below zero: a debt) and answers (True, level after); else
        (False, level), taking nothing. Atomic across every process sharing the store."""

    async def seat(self, key: str, limit: int | None, ttl_s: float) -> bool:
        """One more seat counted under ``key`` if fewer than ``limit`` are (None: no limit); False when full. The
        count forgets itself ``ttl_s`` after its last change (seats of a process that died are not held forever)."""

    async def unseat(self, key: str) -> None:
        """One seat fewer."""

    # ---- bounded sets: what a key keeps (its stored responses), bounded by count and bytes, the oldest going first
    async def keep(self, key: str, member: str, size: int, max_count: int, max_bytes: int,
                   ttl_s: float) -> list[str]:
        """Counts ``member`` (``size`` bytes; counted already: its size now) in the set ``key`` as its newest, forgets
        members not counted again for ``ttl_s``, then drops the oldest (never ``member``) while the set holds more
        than ``max_count`` members or ``max_bytes``: returns those dropped. Atomic across every process sharing
        the store."""

    async def forget(self, key: str, members: list[str]) -> None:
        """``members`` out of the set ``key``."""

    # ---- wake-ups
    async def publish(self, channel: str, message: bytes) -> None: ...
    def subscribe(self, channel: str, listener: Listener) -> None:
        """``listener(message)`` is called on this event loop for every message published on ``channel`` (by this
        process too) from now on; one subscription per channel and process."""


def redacted(url: str) -> str:
    """A store's URL without its password."""
    scheme, sep, rest = url.partition("://")
    if "@" in rest:
        rest = "***@" + rest.split("@", 1)[1]
    return f"{scheme}{sep}{rest}"


async def every(interval_s: Callable[[], float] | float, work: Callable[[], Awaitable[object]], what: str) -> None:
    """``work()`` again and again, ``interval_s`` apart, for ever: a store that is away (StoreUnavailable) is tried
    again at the next turn, any other failure logged as ``what`` failing."""
    while True:
        try:
            await work()
        except StoreUnavailable:
            pass
        except Exception:
            logging.getLogger("parrot.state").exception("%s failed", what)
        await asyncio.sleep(interval_s() if callable(interval_s) else interval_s)
