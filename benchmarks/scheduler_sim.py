"""The global scheduler at scale, by simulation: the gateway's own scheduler code (gateway/scheduler.py) placing a
synthetic trace over 10 → 1,000 simulated engines, against a cache-aware router's policy in the same simulator.

Trace: ``--apps`` apps (10,000), each with its own system prompt (500-2,000 tokens), chosen by Zipf popularity
(a few hot apps, a long tail); each request is the app's prompt + a 50-token user turn, answered with 64 tokens;
Poisson arrivals at ``--load`` of the engines' capacity.
Engine cost model: prefill at ``--prefill-tps`` tokens/s of what is not cached, decode at ``--decode-tps``
tokens/s (continuous batching folded into one rate), FIFO; a KV cache of ``--kv-tokens`` tokens holding whole
prompts, LRU (the truth the policies only guess at).
Policies: ``parrot`` (Scheduler.best over engine views; its mirror sized from each engine's reported capacity),
``cache_aware`` (sglang-router / vllm-router: if the loads are imbalanced, the shortest queue; else the engine
whose radix tree matches most of the prompt when it matches over half, else the one with the smallest tree; its
tree does not know what the engine evicted), ``least_loaded``, ``round_robin``.
Reported per engine count: hit rate (prompt tokens served from cache), mean and p90 latency, and the parrot
scheduler's decision time per request (p50 / p99; target p99 < 1 ms at 1,000 engines).

    python -m benchmarks.scheduler_sim                  # 10, 100, 1,000 engines; JSON + PNG in docs/benchmarks/
"""

from __future__ import annotations

import argparse
import bisect
import collections
import itertools
import random
import statistics
import time
from pathlib import Path
from typing import Callable

import msgspec

from benchmarks.results_file import TRACKED, write_results
from engines.seam import EngineStats
from gateway.config import SchedulerConfig
from gateway.engine_view import EngineView
from gateway.prompt_prefix import TOKENS_PER_CHUNK
from gateway.scheduler import Scheduler, Work

USER_TOKENS, OUTPUT_TOKENS = 50, 64


class SimEngine(EngineView, kw_only=True):
    """An engine of the cost model: a FIFO server with an LRU cache of whole prompts."""

    free_at: float = 0.0
    finishes: collections.deque = msgspec.field(default_factory=collections.deque)  # its requests' ends
    cache: collections.OrderedDict = msgspec.field(default_factory=collections.OrderedDict)  # app → prompt tokens
    cached_tokens: int = 0
    now: list = msgspec.field(default_factory=lambda: [0.0])  # the simulation clock, shared by all engines

    def load(self) -> int:
        while self.finishes and self.finishes[0] <= self.now[0]:
            self.finishes.popleft()
        return len(self.finishes)


def make_engines(count: int, kv_tokens: int) -> list[SimEngine]:
    clock = [0.0]
    stats = EngineStats(blocks_total=kv_tokens // 16, block_size=16)
    return [SimEngine(id=f"e{i}", models=["m"], stats=stats, now=clock) for i in range(count)]


class Trace:
    def __init__(self, apps: int, seed: int):
        rng = random.Random(seed)
        self.prompt_tokens = [rng.randint(500, 2000) for _ in range(apps)]
        # The app's prompt as the scheduler sees it: a chain of one hash per 64-token chunk, unique per app.
        self.chains = [tuple(hash((app, i)) for i in range(tokens // TOKENS_PER_CHUNK))
                       for app, tokens in enumerate(self.prompt_tokens)]
        weights = [1 / (rank + 1) ** 1.1 for rank in range(apps)]
        self.cumulative = list(itertools.accumulate(weights))

    def requests(self, count: int, rate: float, seed: int) -> list[tuple[float, int]]:
        rng = random.Random(seed)
        now, out = 0.0, []
        total = self.cumulative[-1]
        for _ in range(count):
            now += rng.expovariate(rate)
            out.append((now, bisect.bisect_left(self.cumulative, rng.random() * total)))
        return out


Policy = Callable[[int, list[SimEngine]], SimEngine]


def parrot_policy(trace: Trace, decision_s: list[float]) -> Policy:
    scheduler = Scheduler(SchedulerConfig())

    def place(app: int, engines: list[SimEngine]) -> SimEngine:
        work = Work(trace.chains[app], trace.prompt_tokens[app] + USER_TOKENS)
        started = time.perf_counter()
        chosen = scheduler.place(work, engines)
        decision_s.append(time.perf_counter() - started)
        return chosen

    return place


def cache_aware_policy(trace: Trace, cache_threshold: float = 0.5, balance_abs: int = 32,
                       balance_rel: float = 1.0001) -> Policy:
    """sglang-router's cache_aware, on whole prompts: its trees remember every prompt routed (they are pruned by
    size far above one engine's KV), so they do not know what an engine evicted."""
    trees: dict[str, set[int]] = collections.defaultdict(set)
    tree_tokens: dict[str, int] = collections.defaultdict(int)

    def place(app: int, engines: list[SimEngine]) -> SimEngine:
        loads = [e.load() for e in engines]
        low, high = min(loads), max(loads)
        if high - low > balance_abs and high > low * balance_rel:
            chosen = engines[loads.index(low)]
        else:
            holders = [e for e in engines if app in trees[e.id]]
            match_rate = 1.0 if holders else 0.0  # prompts are whole: a holder's tree matches all of it
            if match_rate > cache_threshold:
                chosen = holders[0]
            else:
                chosen = min(engines, key=lambda e: tree_tokens[e.id])
        if app not in trees[chosen.id]:
            trees[chosen.id].add(app)
            tree_tokens[chosen.id] += trace.prompt_tokens[app]
        return chosen

    return place


def least_loaded_policy() -> Policy:
    turn = itertools.count()

    def place(app: int, engines: list[SimEngine]) -> SimEngine:
        start = next(turn) % len(engines)
        return min(engines[start:] + engines[:start], key=lambda e: e.load())

    return place


def round_robin_policy() -> Policy:
    turn = itertools.count()
    return lambda app, engines: engines[next(turn) % len(engines)]


def simulate(policy: Policy, trace: Trace, engines: list[SimEngine], requests: list[tuple[float, int]],
             args: argparse.Namespace) -> dict[str, float]:
    latencies, hit_tokens, prompt_tokens = [], 0, 0
    for arrival, app in requests:
        engines[0].now[0] = arrival
        engine = policy(app, engines)
        prompt = trace.prompt_tokens[app]
        hit = app in engine.cache
        if hit:
            engine.cache.move_to_end(app)
            hit_tokens += prompt
        else:
            engine.cache[app] = prompt
            engine.cached_tokens += prompt
            while engine.cached_tokens > args.kv_tokens:
                engine.cached_tokens -= engine.cache.popitem(last=False)[1]
        prompt_tokens += prompt + USER_TOKENS
        computed = USER_TOKENS + (0 if hit else prompt)
        service = computed / args.prefill_tps + OUTPUT_TOKENS / args.decode_tps
        engine.load()
        start = max(arrival, engine.free_at)
        engine.free_at = start + service
        engine.finishes.append(engine.free_at)
        latencies.append(engine.free_at - arrival)
    latencies.sort()
    return {"hit_rate": hit_tokens / prompt_tokens, "mean_latency_s": statistics.fmean(latencies),
            "p90_latency_s": latencies[int(0.9 * len(latencies))]}


def run(count: int, trace: Trace, args: argparse.Namespace) -> dict[str, dict[str, float]]:
    # Capacity if every request hit: 1 / service time of a hit, per engine.
    hit_service = USER_TOKENS / args.prefill_tps + OUTPUT_TOKENS / args.decode_tps
    rate = args.load * count / hit_service
    requests = trace.requests(max(args.min_requests, args.requests_per_engine * count), rate, seed=count)
    decisions: list[float] = []
    policies = {"parrot": parrot_policy(trace, decisions), "cache_aware": cache_aware_policy(trace),
                "least_loaded": least_loaded_policy(), "round_robin": round_robin_policy()}
    results = {}
    for name, policy in policies.items():
        results[name] = simulate(policy, trace, make_engines(count, args.kv_tokens), requests, args)
    decisions.sort()
    results["parrot"]["decision_p50_ms"] = decisions[len(decisions) // 2] * 1e3
    results["parrot"]["decision_p99_ms"] = decisions[int(0.99 * len(decisions))] * 1e3
    results["rate_rps"] = {"value": rate}
    return results


def plot(figures: dict[int, dict[str, dict[str, float]]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    counts = sorted(figures)
    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for name in ("parrot", "cache_aware", "least_loaded", "round_robin"):
        axes[0].plot(counts, [figures[c][name]["hit_rate"] for c in counts], marker="o", label=name)
        axes[1].plot(counts, [figures[c][name]["mean_latency_s"] for c in counts], marker="o", label=name)
    axes[2].plot(counts, [figures[c]["parrot"]["decision_p50_ms"] for c in counts], marker="o", label="p50")
    axes[2].plot(counts, [figures[c]["parrot"]["decision_p99_ms"] for c in counts], marker="o", label="p99")
    for axis, title in zip(axes, ("prefix hit rate", "mean latency (s)", "parrot decision time (ms)")):
        axis.set_xscale("log")
        axis.set_xlabel("engines")
        axis.set_title(title)
        axis.legend()
    axes[1].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--apps", type=int, default=10_000)
    parser.add_argument("--requests-per-engine", type=int, default=40)
    parser.add_argument("--min-requests", type=int, default=20_000, help="per engine count, whatever the engines")
    parser.add_argument("--load", type=float, default=0.5, help="arrival rate as a fraction of all-hit capacity")
    parser.add_argument("--prefill-tps", type=float, default=10_000.0)
    parser.add_argument("--decode-tps", type=float, default=1_000.0)
    parser.add_argument("--kv-tokens", type=int, default=25_000, help="each engine's KV cache (~20 prompts)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default=str(TRACKED / "scheduler_sim.json"))
    args = parser.parse_args()

    trace = Trace(args.apps, args.seed)
    figures = {}
    print(f"{'engines':>8} {'policy':<13} {'hit rate':>9} {'mean s':>8} {'p90 s':>8}  decision p50 / p99 ms")
    for count in args.engines:
        figures[count] = run(count, trace, args)
        for name in ("parrot", "cache_aware", "least_loaded", "round_robin"):
            row = figures[count][name]
            timing = (f"  {row['decision_p50_ms']:.3f} / {row['decision_p99_ms']:.3f}" if name == "parrot" else "")
            print(f"{count:>8} {name:<13} {row['hit_rate']:>9.3f} {row['mean_latency_s']:>8.3f} "
                  f"{row['p90_latency_s']:>8.3f}{timing}")
        ratio = figures[count]["cache_aware"]["mean_latency_s"] / figures[count]["parrot"]["mean_latency_s"]
        print(f"{'':>8} cache_aware mean latency / parrot's: {ratio:.2f}x")
    out = write_results(args.out, {"args": vars(args), "figures": figures})
    plot(figures, out.with_suffix(".png"))
    print(f"saved {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
