"""Which engines serve which model, which of them are healthy, and which one takes the next request."""

from __future__ import annotations

import itertools
import secrets
import time
from typing import Iterator

import msgspec

from engines.base import Engine, EngineStats

# An engine that failed to connect is skipped for this long before it is tried again.
FAILURE_COOLDOWN_S = 5.0


class EngineRecord(msgspec.Struct, kw_only=True):
    id: str
    engine: Engine
    models: list[str]
    kind: str = "upstream"  # "upstream" or "builtin"
    url: str | None = None
    in_flight: int = 0
    down_until: float = 0.0
    last_heartbeat: float | None = None  # None: not heartbeating (static upstreams)
    stats: EngineStats = msgspec.field(default_factory=EngineStats)

    def healthy(self, now: float, heartbeat_timeout_s: float) -> bool:
        if now < self.down_until:
            return False
        return self.last_heartbeat is None or now - self.last_heartbeat <= heartbeat_timeout_s


class EngineRegistry:
    def __init__(self, heartbeat_timeout_s: float = 10.0):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._records: dict[str, EngineRecord] = {}
        self._tiebreak = itertools.count()

    def add(self, engine: Engine, models: list[str], *, kind: str = "upstream", url: str | None = None,
            heartbeating: bool = False) -> EngineRecord:
        record = EngineRecord(
            id=f"eng-{secrets.token_hex(8)}", engine=engine, models=list(models), kind=kind, url=url,
            last_heartbeat=time.monotonic() if heartbeating else None,
        )
        self._records[record.id] = record
        return record

    def remove(self, engine_id: str) -> EngineRecord | None:
        return self._records.pop(engine_id, None)

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._records.get(engine_id)

    def records(self) -> list[EngineRecord]:
        return list(self._records.values())

    def models(self) -> list[str]:
        return sorted({m for r in self._records.values() for m in r.models})

    def serves(self, model: str) -> bool:
        return any(model in r.models for r in self._records.values())

    def heartbeat(self, engine_id: str, stats: EngineStats) -> bool:
        record = self._records.get(engine_id)
        if record is None or record.last_heartbeat is None:  # static upstreams don't heartbeat
            return False
        record.last_heartbeat = time.monotonic()
        record.stats = stats
        return True

    def candidates(self, model: str) -> Iterator[EngineRecord]:
        """Healthy engines for ``model``, least loaded first (round-robin among equals)."""
        now = time.monotonic()
        healthy = [r for r in self._records.values()
                   if model in r.models and r.healthy(now, self.heartbeat_timeout_s)]
        if healthy:
            turn = next(self._tiebreak) % len(healthy)
            healthy = healthy[turn:] + healthy[:turn]  # rotate, then a stable sort keeps equals fair
            healthy.sort(key=lambda r: r.in_flight + r.stats.waiting)
        return iter(healthy)

    @staticmethod
    def mark_down(record: EngineRecord) -> None:
        record.down_until = time.monotonic() + FAILURE_COOLDOWN_S

    async def aclose(self) -> None:
        for record in self._records.values():
            await record.engine.aclose()
        self._records.clear()
