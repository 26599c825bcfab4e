"""How a client-orchestrated app's requests reach an engine: a plain load balancer (round robin), or a cache-aware
router as vllm-router 0.1.17 and sglang-router run their ``cache_aware`` policy. Each decides one request at a
time, from the request alone: none sees an app's graph.

cache_aware, with vllm-router's defaults (``--cache-threshold 0.3 --balance-abs-threshold 64
--balance-rel-threshold 1.5``): when the engines' loads (the requests the router has in flight on each) are
imbalanced (max - min > 64 and max > 1.5 × min), the least loaded engine; otherwise the engine whose prefix tree
matches most of the prompt, if it matches more than 30% of it, else the engine with the smallest tree; the prompt
is then added to that engine's tree. The trees are pruned only past 32 M characters each, so they remember
prefixes the engines have long evicted. The simulation matches in 16-token steps (the routers match characters).
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from typing import Protocol, Sequence

from benchmarks.sim.engine import SimEngine
from benchmarks.sim.prompt import Piece, chain, tokens

MATCH_TOKENS = 16


class Router(Protocol):
    def pick(self, pieces: Sequence[Piece], engines: list[SimEngine]) -> tuple[SimEngine, int]:
        """The engine for a request of this prompt, and the priority it is sent with."""
        ...

    def done(self, engine: SimEngine, level: int) -> None: ...


class RoundRobin:
    def __init__(self) -> None:
        self._turn = itertools.count()

    def pick(self, pieces: Sequence[Piece], engines: list[SimEngine]) -> tuple[SimEngine, int]:
        return engines[next(self._turn) % len(engines)], 0

    def done(self, engine: SimEngine, level: int) -> None:
        pass


class CacheAware:
    def __init__(self, cache_threshold: float = 0.3, balance_abs: int = 64, balance_rel: float = 1.5):
        self.cache_threshold, self.balance_abs, self.balance_rel = cache_threshold, balance_abs, balance_rel
        self._trees: dict[str, set[int]] = defaultdict(set)
        self._tree_tokens: dict[str, int] = defaultdict(int)
        self._in_flight: dict[str, int] = defaultdict(int)

    def pick(self, pieces: Sequence[Piece], engines: list[SimEngine]) -> tuple[SimEngine, int]:
        blocks, prompt_tokens = chain(pieces, MATCH_TOKENS), tokens(pieces)
        loads = [self._in_flight[e.name] for e in engines]
        low, high = min(loads), max(loads)
        if high - low > self.balance_abs and high > low * self.balance_rel:
            chosen = engines[loads.index(low)]
        else:
            matched = [self._matched(blocks, e.name) for e in engines]
            best = max(range(len(engines)), key=lambda i: (matched[i], -i))
            if prompt_tokens and matched[best] * MATCH_TOKENS / prompt_tokens > self.cache_threshold:
                chosen = engines[best]
            else:
                chosen = min(engines, key=lambda e: self._tree_tokens[e.name])
        tree = self._trees[chosen.name]
        for block in blocks:
            if block not in tree:
                tree.add(block)
                self._tree_tokens[chosen.name] += MATCH_TOKENS
        self._in_flight[chosen.name] += 1
        return chosen, 0

    def done(self, engine: SimEngine, level: int) -> None:
        self._in_flight[engine.name] -= 1

    def _matched(self, chain: Sequence[int], name: str) -> int:
        tree = self._trees.get(name, ())
        for i, block in enumerate(chain):
            if block not in tree:
                return i
        return len(chain)
