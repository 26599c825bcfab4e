"""A fleet's traffic: many apps at once, arriving as Poisson streams, each run its own user's (its values named
apart: app_run.AppRun's salt), drawn from a few built apps of each kind (building one tokenizes its text).

- ``apps``: chain summarization, map-reduce and the multi-agent exchange in equal parts (benchmarks/apps.py's
  default shapes);
- ``mixed``: the mixed workload's chat users (multi-turn, think time) and its map-reduce jobs (8 chunks of 100
  words, 24-token maps, a 32-token reduce), as benchmarks/mixed_traffic.py sends them, scaled to the fleet.
"""

from __future__ import annotations

import functools
import random
from dataclasses import replace

from benchmarks.sim.app import App
from benchmarks.sim.catalog import BUILDERS, chat_app, map_reduce_app
from benchmarks.workloads import mixed

POOL = 6  # built apps of each kind
APP_KINDS = ("chain", "map_reduce", "multi_agent")


@functools.lru_cache(maxsize=None)
def _pool(kind: str) -> tuple[App, ...]:
    if kind == "chat":
        return tuple(chat_app(seed) for seed in range(1, POOL + 1))
    if kind == "job":
        return tuple(map_reduce_app(replace(mixed.Config.job, seed=seed)) for seed in range(1, POOL + 1))
    return tuple(BUILDERS[kind](seed) for seed in range(1, POOL + 1))


def _poisson(rng: random.Random, rate: float, duration_s: float) -> list[float]:
    times, at = [], rng.expovariate(rate)
    while at < duration_s:
        times.append(at)
        at += rng.expovariate(rate)
    return times


def apps(engines: int, apps_per_engine_s: float, duration_s: float, seed: int = 0) -> list[tuple[float, App]]:
    rng = random.Random(seed)
    return [(at, rng.choice(_pool(rng.choice(APP_KINDS))))
            for at in _poisson(rng, apps_per_engine_s * engines, duration_s)]


def mixed_traffic(engines: int, chats_per_engine_s: float, jobs_per_engine_s: float, duration_s: float,
                  seed: int = 0) -> list[tuple[float, App]]:
    rng = random.Random(seed)
    starts = [(at, rng.choice(_pool("chat"))) for at in _poisson(rng, chats_per_engine_s * engines, duration_s)]
    starts += [(at, rng.choice(_pool("job"))) for at in _poisson(rng, jobs_per_engine_s * engines, duration_s)]
    return sorted(starts, key=lambda start: start[0])
