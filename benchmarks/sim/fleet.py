"""The engines of a run, each shown to the gateway's real scheduler (gateway/scheduler.py) as the registry shows
it a vLLM upstream: an EngineView whose load and stats are the engine's own, read when it places work (the gateway
reads vLLM's /metrics every quarter second; the simulation reads them exact)."""

from __future__ import annotations

from typing import Any

from benchmarks.sim.clock import Clock
from benchmarks.sim.engine import SimEngine
from benchmarks.sim.step_cost import EngineShape, StepCost
from gateway.engine_view import EngineView

MODEL = "m"


class Seat(EngineView, kw_only=True):
    engine: Any = None  # the SimEngine behind the view

    def load(self) -> int:
        return self.engine.load()


class Fleet:
    def __init__(self, clock: Clock, cost: StepCost, shape: EngineShape, count: int):
        self.clock = clock
        self.engines = [SimEngine(f"e{i}", clock, cost, shape) for i in range(count)]
        self._seats = [Seat(id=engine.name, models=[MODEL], engine=engine) for engine in self.engines]

    def seats(self) -> list[Seat]:
        """The engines' views, their stats as of now."""
        for seat in self._seats:
            seat.stats = seat.engine.stats()
        return self._seats

    def hit_rate(self) -> float:
        """Prompt tokens the engines found in their prefix caches, of all they were asked."""
        queries = sum(e.cache.queries for e in self.engines)
        return sum(e.cache.hits for e in self.engines) / queries if queries else 0.0

    def computed_tokens(self) -> int:
        return sum(e.computed_tokens for e in self.engines)
