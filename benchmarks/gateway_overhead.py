"""Gateway overhead: direct-to-upstream vs through Parrot (and optionally another gateway), in one run.

Starts the fast fake upstream and a Parrot gateway as their own processes on loopback, then runs
alternating rounds (direct, parrot, [compare], direct, parrot, ...) at a fixed concurrency, for
non-streaming and streaming requests, and prints p50/p99 latency, requests/s, the added p50 and the
rps ratio. Medians over rounds are reported because this machine is shared and noisy.

    python -m benchmarks.gateway_overhead                       # defaults: concurrency 8, 9 rounds of 500
    python -m benchmarks.gateway_overhead --compare-url http://127.0.0.1:4000/v1 --compare-model fake
      (e.g. a LiteLLM proxy started against the fake upstream this script prints)
    python -m benchmarks.gateway_overhead --states memory,sqlite,redis --quota-rpm 100000000 --semantic \
        --concurrency 1,8
      (one gateway per state store, in the same run: redis starts a redis-server on a free port unless
      --redis-url names one; --quota-rpm puts every request through the key's rate bucket, --semantic
      makes each request a semantic one: its variable and output written to the store; with 1 client the
      added p50 is a request's own added latency, with 8 on this 2-CPU host it is mostly queueing behind
      the others' CPU time)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from benchmarks.results_file import write_results, save_figure
from http_plumbing.aiohttp_transport import AiohttpTransport


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_ready(url: str, timeout_s: float = 30.0) -> None:
    """Polls ``url`` with one client: ``httpx.get`` builds a client and an SSL context per call (~47 ms of CPU
    here), which at 10 polls a second took half a core from the process starting beside it."""
    deadline = time.monotonic() + timeout_s
    with httpx.Client(timeout=1.0, limits=httpx.Limits(max_keepalive_connections=0)) as client:
        while time.monotonic() < deadline:
            try:
                if client.get(url).status_code < 500:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def start(args: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-m", *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


SEMANTIC = False  # --semantic: each request binds a value to a variable (the gateway's default session)


def request_body(model: str, stream: bool) -> dict:
    body = {"model": model, "max_tokens": 16, "fake": {"words": 16},
            "messages": [{"role": "user", "content": "Say sixteen words about parrots."}]}
    if SEMANTIC:
        body["messages"] = [{"role": "user", "content": "Say sixteen words about {{topic}}."}]
        body["parrot"] = {"vars": {"topic": {"value": "parrots"}}}
    if stream:
        body |= {"stream": True, "stream_options": {"include_usage": True}}
    return body


async def one(client: httpx.AsyncClient, url: str, body: dict) -> float:
    started = time.perf_counter()
    if body.get("stream"):
        async with client.stream("POST", url, json=body) as response:
            response.raise_for_status()
            async for _ in response.aiter_raw():
                pass
    else:
        response = await client.post(url, json=body)
        response.raise_for_status()
    return time.perf_counter() - started


async def round_(client: httpx.AsyncClient, base_url: str, model: str, stream: bool, requests: int,
                 concurrency: int) -> dict:
    url, body = f"{base_url}/chat/completions", request_body(model, stream)
    latencies: list[float] = []
    remaining = iter(range(requests))

    async def worker() -> None:
        for _ in remaining:
            latencies.append(await one(client, url, body))

    started = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    elapsed = time.perf_counter() - started
    latencies.sort()
    return {"p50": statistics.median(latencies), "p99": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
            "rps": requests / elapsed}


async def run(targets: dict[str, tuple[str, str]], args: argparse.Namespace) -> dict:
    levels = [int(c) for c in str(args.concurrency).split(",")]
    most = max(levels)
    limits = httpx.Limits(max_connections=most * 2, max_keepalive_connections=most * 2)
    results: dict = {}
    # the load generator shares the 2 cores with what it measures: give it the lighter transport too
    async with httpx.AsyncClient(limits=limits, timeout=30.0, transport=AiohttpTransport(limits=limits)) as client:
        for concurrency in levels:
            for stream in (False, True):
                mode = "streaming" if stream else "non-streaming"
                if len(levels) > 1:  # several levels: 1 client is the added latency alone, more add queueing
                    mode = f"{mode}, {concurrency} client{'s' if concurrency > 1 else ''}"
                for name, (url, model) in targets.items():  # warm-up: connections, caches, JIT-free paths
                    await round_(client, url, model, stream, concurrency * 10, concurrency)
                rounds: dict[str, list[dict]] = {name: [] for name in targets}
                for _ in range(args.rounds):
                    for name, (url, model) in targets.items():  # alternate so drift hits everyone alike
                        rounds[name].append(await round_(client, url, model, stream, args.requests, concurrency))
                results[mode] = summarize(rounds)
    return results


def summarize(rounds: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    """Medians over rounds; the added p50 and the rps ratio are medians of each round's difference to the
    direct round just before it, so that load drifting over the run (this machine is shared) cancels."""
    direct = rounds.get("direct") or next(iter(rounds.values()))
    memory = rounds.get("parrot-memory")  # with --states: each store's p50 over the in-memory one's, paired too
    return {name: {**{k: statistics.median(r[k] for r in rs) for k in ("p50", "p99", "rps")},
                   "added_p50": statistics.median(r["p50"] - d["p50"] for r, d in zip(rs, direct)),
                   "rps_ratio": statistics.median(r["rps"] / d["rps"] for r, d in zip(rs, direct)),
                   **({"p50_over_memory": statistics.median(r["p50"] - m["p50"] for r, m in zip(rs, memory))}
                      if memory else {})}
            for name, rs in rounds.items()}


def report(results: dict) -> None:
    for mode, by_target in results.items():
        print(f"\n{mode} (medians over rounds; added p50 and rps ratio paired with each round's direct run)")
        print(f"{'target':<14} {'p50 ms':>8} {'p99 ms':>8} {'req/s':>8} {'added p50 ms':>13} {'rps vs direct':>14}"
              f" {'p50 over memory ms':>19}")
        for name, r in by_target.items():
            over = f"{r['p50_over_memory'] * 1000:19.2f}" if "p50_over_memory" in r else f"{'':>19}"
            print(f"{name:<14} {r['p50'] * 1000:8.2f} {r['p99'] * 1000:8.2f} {r['rps']:8.0f} "
                  f"{r['added_p50'] * 1000:13.2f} {r['rps_ratio']:13.2f}x {over}")


def plot(results: dict, path: Path, title: str) -> None:
    """Each store's added p50 over the in-memory gateway, per mode, against the targets (SQLite 1 ms, Redis 2 ms)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(7, 3.5))
    stores = [name for name in next(iter(results.values())) if name.startswith("parrot-") and name != "parrot-memory"]
    width = 0.8 / max(1, len(results))
    for i, (mode, by_target) in enumerate(results.items()):
        axes.bar([j + i * width for j in range(len(stores))],
                 [by_target[name]["p50_over_memory"] * 1000 for name in stores], width, label=mode)
    for j, name in enumerate(stores):
        target = {"parrot-sqlite": 1.0, "parrot-redis": 2.0}.get(name)
        if target is not None:
            axes.hlines(target, j - 0.1, j + 0.8, colors="red", linestyles="dashed")
    axes.set_xticks([j + width * (len(results) - 1) / 2 for j in range(len(stores))], stores)
    axes.set_ylabel("p50 over in-memory (ms); dashed: target")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    save_figure(figure, path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", default="8", help="clients at once; a comma-separated list runs each level")
    parser.add_argument("--requests", type=int, default=500, help="requests per round")
    parser.add_argument("--rounds", type=int, default=9, help="alternating rounds per target (medians reported)")
    parser.add_argument("--upstream-port", type=int, default=0, help="fixed port for the fake upstream")
    parser.add_argument("--compare-url", help="another gateway's base URL (ending in /v1) to measure the same way")
    parser.add_argument("--compare-model", default="fake", help="model name to ask the compared gateway for")
    parser.add_argument("--states", help="comma-separated state stores, one gateway each: memory, sqlite, redis "
                                         "(default: one gateway, in memory)")
    parser.add_argument("--redis-url", help="the Redis for --states redis (default: a redis-server started here)")
    parser.add_argument("--quota-rpm", type=int, help="a requests-per-minute quota on every key: admission counted "
                                                     "in each gateway's store")
    parser.add_argument("--semantic", action="store_true",
                        help="semantic requests (a value bound to a placeholder): sessions and variables in the store")
    parser.add_argument("--out", default="benchmarks/results/gateway_overhead.json")
    args = parser.parse_args()
    global SEMANTIC
    SEMANTIC = args.semantic

    upstream_port = args.upstream_port or free_port()
    upstream_url = f"http://127.0.0.1:{upstream_port}/v1"
    procs = [start(["benchmarks.fake_upstream", "--port", str(upstream_port)])]
    scratch = Path(tempfile.mkdtemp(prefix="parrot-overhead-"))
    gateways: dict[str, int] = {}
    env = {"PARROT_QUOTA_REQUESTS_PER_MINUTE": str(args.quota_rpm)} if args.quota_rpm else {}
    for state in (args.states.split(",") if args.states else [None]):
        where = ["--state", "memory://"]  # as the gateway kept everything before it had a store
        if state == "memory":
            where = ["--state", "memory://"]
        elif state == "sqlite":
            where = ["--state", str(scratch / "state.sqlite3")]
        elif state == "redis":
            url = args.redis_url
            if url is None:
                redis_port = free_port()
                procs.append(subprocess.Popen(
                    [shutil.which("redis-server") or shutil.which("valkey-server") or "redis-server", "--port",
                     str(redis_port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no", "--dir", str(scratch)],
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
                url = f"redis://127.0.0.1:{redis_port}/0"
            where = ["--state", url]
        elif state is not None:
            raise SystemExit(f"unknown state store {state!r}: memory, sqlite or redis")
        port = free_port()
        procs.append(start(["gateway.server.cli", "serve", "--no-builtin", "--port", str(port), "--log-level",
                            "warning", "--upstream", f"fake={upstream_url}", *where], env))
        gateways["parrot" if state is None else f"parrot-{state}"] = port
    try:
        wait_ready(f"{upstream_url}/models")
        for port in gateways.values():
            wait_ready(f"http://127.0.0.1:{port}/health")
        print(f"fake upstream: {upstream_url}   " + "   ".join(f"{name}: http://127.0.0.1:{port}/v1"
                                                          for name, port in gateways.items()))
        targets = {"direct": (upstream_url, "fake"),
                   **{name: (f"http://127.0.0.1:{port}/v1", "fake") for name, port in gateways.items()}}
        if args.compare_url:
            targets["compare"] = (args.compare_url.rstrip("/"), args.compare_model)
        load_before = os.getloadavg()  # the host is shared: what else ran is part of the record
        results = asyncio.run(run(targets, args))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(timeout=10)
    report(results)
    out = Path(args.out)
    write_results(out, {"args": vars(args), "cpu": _cpu_model(), "load_average": [load_before, os.getloadavg()],
                        "results": results})
    if args.states and "memory" in args.states.split(","):
        plot(results, out.with_suffix(".png"), f"gateway overhead per state store ({'semantic' if args.semantic else 'plain'}"
                                               f" requests, {args.concurrency} clients), shared 2-CPU host")
    print(f"\nsaved {out}")


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next(line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name"))
    except (OSError, StopIteration):
        return "unknown"


if __name__ == "__main__":
    main()
