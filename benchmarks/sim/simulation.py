"""A simulated run: apps started at given times on a fleet, orchestrated one way, every app's completion time
out. Modes: ``parrot`` (Parrot's gateway runs each app's graph), ``client`` (the client calls, through a round-robin
load balancer), ``client_cache_aware`` (the client calls, through vllm-router's cache_aware policy)."""

from __future__ import annotations

from typing import Any, Sequence as Seq

import msgspec

from benchmarks.sim.app import App
from benchmarks.sim.app_run import AppRun
from benchmarks.sim.client import Client
from benchmarks.sim.clock import Clock
from benchmarks.sim.fleet import Fleet
from benchmarks.sim.gateway import ParrotGateway
from benchmarks.sim.router import CacheAware, RoundRobin
from benchmarks.sim.step_cost import EngineShape, StepCost

MODES = ("parrot", "client", "client_cache_aware")


class Outcome(msgspec.Struct, kw_only=True):
    seconds: dict[str, list[float]]  # app name → each run's completion time, in start order
    # plain apps' calls (chat turns): seconds per output token from the client's sending to its answer (the mixed
    # workload's measure), by app name
    normalized: dict[str, list[float]]
    hit_rate: float  # prompt tokens the engines' prefix caches served, of all looked up
    computed_tokens: int  # prompt tokens the engines computed
    busy_s: float  # engine-seconds spent in steps
    makespan_s: float
    prefills: int = 0
    prefill_skips: int = 0
    warmed_placed: int = 0  # of the prefilled calls, those then placed where they were warmed


def simulate(mode: str, starts: Seq[tuple[float, App]], cost: StepCost, shape: EngineShape, engines: int,
             rtt_s: float, **gateway: Any) -> Outcome:
    clock = Clock()
    fleet = Fleet(clock, cost, shape, engines)
    if mode == "parrot":
        front: ParrotGateway | Client = ParrotGateway(clock, fleet, rtt_s, **gateway)
    else:
        front = Client(clock, fleet, CacheAware() if mode == "client_cache_aware" else RoundRobin(), rtt_s)
    runs: list[AppRun] = []

    def launch(i: int, app: App) -> None:
        runs.append(front.start(app, f"r{i}", lambda run: None))

    for i, (at, app) in enumerate(starts):
        clock.at(at, lambda i=i, app=app: launch(i, app))
    clock.run()
    seconds: dict[str, list[float]] = {}
    normalized: dict[str, list[float]] = {}
    for run in sorted(runs, key=lambda r: int(r.id[1:])):
        seconds.setdefault(run.app.name, []).append(run.seconds)
        for call, taken in run.call_seconds.items():
            if run.app.plain:
                normalized.setdefault(run.app.name, []).append(taken / run.calls[call].output_tokens)
    return Outcome(seconds=seconds, normalized=normalized, hit_rate=fleet.hit_rate(),
                   computed_tokens=fleet.computed_tokens(), busy_s=sum(e.busy_s for e in fleet.engines),
                   makespan_s=clock.now, prefills=getattr(front, "prefills", 0),
                   prefill_skips=getattr(front, "prefill_skips", 0), warmed_placed=getattr(front, "warmed_placed", 0))
