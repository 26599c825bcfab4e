"""Many engines, one brain: the seed paper's GPTs workload over N builtin engines, placed by each policy in turn.

K apps (GPTs), each with its own long system prompt (``--prompt-words``, ≥ 1,000 tokens) and short user turns,
send Poisson arrivals at rising rates to N engine processes (SmolLM2), whose KV caches hold about two of the
prompts each (``--num-blocks``). The same engines are driven, in alternating order per rate, by:

  parrot         Parrot's gateway, its global scheduler (the engines as plain upstreams: their load and KV
                 capacity read from their /metrics, their prefixes mirrored from what it placed)
  parrot-events  the same, each engine's prefixes read from the KV-cache events it publishes (vLLM's schema,
                 the builtin engine's --kv-events-endpoint; ``kv_events`` upstreams): what it holds, exactly
  least_loaded   the same gateway, ``[scheduler] policy = "least_loaded"``
  round_robin    the same gateway, ``policy = "round_robin"``
  vllm-router    ``vllm-router --policy cache_aware`` (its own venv: --vllm-router BIN)
  sglang-router  ``python -m sglang_router.launch_router --policy cache_aware`` (--sglang-router PYTHON)

Every run restarts the engines (empty caches) and its front, and sends each app's first request alone, one
after another (placed by the policy), before the measured arrivals. Per policy and rate, over the measured
requests: p90 end-to-end latency, mean TTFT, and the prefix-hit rate (prompt tokens the engines' prefix caches
served / all prompt tokens, from the engines' own counters), and the achievable one: the prompt tokens, in full KV
blocks, that an earlier request of the run (its warm-up included) had computed before, as if every engine held
everything (the prompts' token ids from an engine's /tokenize). Per policy: the highest rate whose p90 stays under
``--slo-s``. Every engine publishes its KV events in every run; only ``parrot-events`` subscribes. The host's load
average is recorded with each row (a shared host).

    python -m benchmarks.multi_engine --vllm-router /work/venvs/vr/bin/vllm-router \\
        --sglang-router /work/venvs/sr/bin/python --rates 0.5 1 1.5 2 3
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.gateway_overhead import free_port, wait_ready
from benchmarks.results_file import TRACKED, write_results
from benchmarks.workloads.text import questions, system_prompt

MODEL = "SmolLM2-135M-Instruct"
GATEWAY_POLICIES = ("parrot", "parrot-events", "least_loaded", "round_robin")
BLOCK_SIZE = 16  # the builtin engine's KV block


def start(command: list[str], env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    return subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})


def stop(processes: list[subprocess.Popen[bytes]]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


class Fleet:
    """N engine processes, started fresh for every run."""

    def __init__(self, args: argparse.Namespace):
        self.args = args
        self.ports = [free_port() for _ in range(args.engines)]
        self.event_ports = [(free_port(), free_port()) for _ in range(args.engines)]  # KV events, their replay
        self.processes: list[subprocess.Popen[bytes]] = []

    @property
    def urls(self) -> list[str]:
        return [f"http://127.0.0.1:{port}" for port in self.ports]

    def start(self) -> None:
        self.processes = [start([sys.executable, "-m", "gateway.server.cli", "engine", "--port", str(port),
                                 "--num-blocks", str(self.args.num_blocks), "--num-threads", "1",
                                 "--log-level", "warning", "--kv-events-endpoint", f"tcp://*:{events}",
                                 "--kv-events-replay-endpoint", f"tcp://*:{replay}", *self.args.engine_args.split()])
                          for port, (events, replay) in zip(self.ports, self.event_ports)]
        for url in self.urls:
            wait_ready(f"{url}/v1/models", timeout_s=600)  # a shared host may take minutes

    def kv_events(self) -> list[tuple[str, str]]:
        """Each engine's KV-events endpoint and replay endpoint, as a subscriber connects to them."""
        return [(f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}") for events, replay in self.event_ports]

    def counters(self) -> tuple[int, int]:
        """(prompt tokens, prompt tokens served by prefix caches) over all engines."""
        prompt = hits = 0
        for url in self.urls:
            stats = httpx.get(f"{url}/v1/stats", timeout=10).json()
            prompt += stats["prompt_tokens"]
            hits += stats["prefix_hit_tokens"]
        return prompt, hits

    def stop(self) -> None:
        stop(self.processes)


def start_front(policy: str, fleet: Fleet, args: argparse.Namespace) -> tuple[subprocess.Popen[bytes], str]:
    port = free_port()
    if policy in GATEWAY_POLICIES:
        upstreams = [arg for url in fleet.urls for arg in ("--upstream", f"{MODEL}={url}/v1")]
        config = []
        if policy == "parrot-events":  # its replay endpoint too: in the TOML file, the one place it is set
            config = ["--config", str(_events_config(fleet, port))]
            upstreams = []
        process = start([sys.executable, "-m", "gateway.server.cli", "serve", "--port", str(port), "--no-builtin",
                         "--log-level", "warning", *upstreams, *config],
                        env={"PARROT_SCHEDULER_POLICY": policy.removesuffix("-events"),
                             "PARROT_HEALTH_CHECK_INTERVAL_S": "0.5", "PARROT_STATE": "memory://"})
        ready = f"http://127.0.0.1:{port}/health/ready"
    elif policy == "vllm-router":
        process = start([args.vllm_router, "--worker-urls", *fleet.urls, "--policy", "cache_aware",
                         "--port", str(port), "--prometheus-port", str(free_port()), "--log-level", "error",
                         *args.vllm_router_args.split()])
        ready = f"http://127.0.0.1:{port}/v1/models"
    else:
        process = start([args.sglang_router, "-m", "sglang_router.launch_router", "--worker-urls", *fleet.urls,
                         "--policy", "cache_aware", "--port", str(port), "--prometheus-port", str(free_port()),
                         "--log-level", "error", *args.sglang_router_args.split()])
        ready = f"http://127.0.0.1:{port}/v1/models"
    wait_ready(ready, timeout_s=60)
    return process, f"http://127.0.0.1:{port}/v1"


def _events_config(fleet: Fleet, port: int) -> Path:
    """A gateway config serving the fleet as upstreams with their KV events on."""
    lines = []
    for url, (events, replay) in zip(fleet.urls, fleet.kv_events()):
        lines += ["[[upstreams]]", f'model = "{MODEL}"', f'base_url = "{url}/v1"', f'kv_events = "{events}"',
                  f'kv_events_replay = "{replay}"', ""]
    path = Path(f"/tmp/parrot-multi-engine-{port}.toml")
    path.write_text("\n".join(lines))
    return path


def achievable(bodies: list[dict[str, Any]], warm: list[dict[str, Any]], url: str) -> float:
    """Of ``bodies``' prompt tokens, the fraction in full KV blocks an earlier request (``warm`` first) computed:
    the hit rate of a fleet that held everything."""
    seen: set[int] = set()
    hit = total = 0
    with httpx.Client(timeout=60) as client:
        for i, body in enumerate([*warm, *bodies]):
            tokens = client.post(f"{url}/tokenize", json={"model": MODEL, "messages": body["messages"]}).json()["tokens"]
            chain, previous = [], 0
            for start in range(0, len(tokens) - BLOCK_SIZE + 1, BLOCK_SIZE):
                previous = hash((previous, tuple(tokens[start:start + BLOCK_SIZE])))
                chain.append(previous)
            if i >= len(warm):
                total += len(tokens)
                hit += BLOCK_SIZE * next((k for k, h in enumerate(chain) if h not in seen), len(chain))
            seen.update(chain)
    return hit / total if total else 0.0


def load_average() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class Apps:
    def __init__(self, args: argparse.Namespace, first_seed: int = 1000):
        """``first_seed``: the first app's system prompt's (runs on engines kept running each get prompts of their own)."""
        self.prompts = [system_prompt(first_seed + app, args.prompt_words) for app in range(args.apps)]
        self.questions = questions(7, 64)

    def request(self, rng: random.Random, max_tokens: int, app: int | None = None) -> dict[str, Any]:
        app = rng.randrange(len(self.prompts)) if app is None else app
        return {"model": MODEL, "max_tokens": max_tokens, "temperature": 0, "stream": True,
                "messages": [{"role": "system", "content": self.prompts[app]},
                             {"role": "user", "content": rng.choice(self.questions)}]}


def _has_text(event: str) -> bool:
    choices = json.loads(event).get("choices") or [{}]
    return bool((choices[0].get("delta") or {}).get("content"))


async def one(client: httpx.AsyncClient, url: str, body: dict[str, Any]) -> tuple[float, float, bool]:
    """(TTFT, end-to-end seconds, ok) of one streamed request."""
    started = time.perf_counter()
    ttft = None
    try:
        async with client.stream("POST", f"{url}/chat/completions", json=body) as response:
            if response.status_code != 200:
                await response.aread()
                return 0.0, time.perf_counter() - started, False
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {") and _has_text(line[6:]):
                    ttft = time.perf_counter() - started
    except httpx.HTTPError:
        return 0.0, time.perf_counter() - started, False
    end = time.perf_counter() - started
    return (ttft if ttft is not None else end), end, True


def warm_bodies(apps: Apps, args: argparse.Namespace) -> list[dict[str, Any]]:
    return [apps.request(random.Random(app), args.max_tokens, app=app) for app in range(len(apps.prompts))]


def arrivals(apps: Apps, rate: float, args: argparse.Namespace, seed: int) -> tuple[list[dict[str, Any]], list[float]]:
    rng = random.Random(seed)  # the same arrivals and prompts for every policy at this rate
    bodies = [apps.request(rng, args.max_tokens) for _ in range(args.requests)]
    return bodies, [rng.expovariate(rate) for _ in bodies]


async def warm_up(url: str, apps: Apps, args: argparse.Namespace) -> None:
    """Each app's first user, one after another, placed by the policy: what follows is its steady state."""
    async with httpx.AsyncClient(timeout=600) as client:
        for body in warm_bodies(apps, args):
            await one(client, url, body)


async def drive(url: str, apps: Apps, rate: float, args: argparse.Namespace, seed: int
                ) -> list[tuple[float, float, bool]]:
    bodies, gaps = arrivals(apps, rate, args, seed)
    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        if args.sequential:  # one at a time: placement by what each engine holds alone, no queue to weigh
            return [await one(client, url, body) for body in bodies]
        tasks = []
        for body, gap in zip(bodies, gaps):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(client, url, body)))
        return await asyncio.gather(*tasks)


def measure(policy: str, rate: float, fleet: Fleet, apps: Apps, args: argparse.Namespace) -> dict[str, Any]:
    try:
        if not (args.keep_engines and fleet.processes):
            fleet.start()
        front, url = start_front(policy, fleet, args)
    except BaseException:  # nothing left running behind a run that could not start
        fleet.stop()
        raise
    try:
        best = achievable(arrivals(apps, rate, args, int(rate * 1000))[0], warm_bodies(apps, args), fleet.urls[0])
        asyncio.run(warm_up(url, apps, args))
        before = fleet.counters()
        load = load_average()
        results = asyncio.run(drive(url, apps, rate, args, seed=int(rate * 1000)))
        after = fleet.counters()
    finally:
        stop([front])
        if not args.keep_engines:
            fleet.stop()
    measured = results
    latencies = sorted(end for _, end, ok in measured if ok)
    failed = sum(1 for *_, ok in measured if not ok)
    prompt, hits = after[0] - before[0], after[1] - before[1]
    p90 = latencies[int(0.9 * (len(latencies) - 1))] if latencies else float("inf")
    return {"policy": policy, "rate": rate, "p90_s": p90 if not failed else float("inf"),
            "mean_ttft_s": statistics.fmean(t for t, _, ok in measured if ok) if latencies else None,
            "hit_rate": hits / prompt if prompt else 0.0, "achievable_hit_rate": best,
            "of_achievable": (hits / prompt) / best if prompt and best else 0.0, "failed": failed,
            "load_average": [load, load_average()]}


def sustained(rows: list[dict[str, Any]], policy: str, slo_s: float) -> float:
    """The highest rate (of those run, in order) up to which every rate kept p90 under the SLO."""
    best = 0.0
    for row in sorted((r for r in rows if r["policy"] == policy), key=lambda r: r["rate"]):
        if row["p90_s"] > slo_s:
            break
        best = row["rate"]
    return best


def plot(rows: list[dict[str, Any]], policies: list[str], slo_s: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4))
    for policy in policies:
        rates = sorted({r["rate"] for r in rows if r["policy"] == policy})

        def at(rate: float, key: str) -> float:  # the median of a policy's runs at a rate
            return statistics.median(r[key] for r in rows if r["policy"] == policy and r["rate"] == rate)

        axes[0].plot(rates, [min(at(rate, "p90_s"), 1e3) for rate in rates], marker="o", label=policy)
        axes[1].plot(rates, [at(rate, "hit_rate") for rate in rates], marker="o", label=policy)
    rates = sorted({r["rate"] for r in rows})
    axes[1].plot(rates, [statistics.median(r["achievable_hit_rate"] for r in rows if r["rate"] == rate)
                         for rate in rates], color="grey", linestyle="--", label="achievable")
    axes[0].axhline(slo_s, color="grey", linestyle="--", label="SLO")
    axes[0].set_yscale("log")
    axes[0].set_title("p90 latency (s)")
    axes[1].set_title("prefix-hit rate")
    for axis in axes:
        axis.set_xlabel("requests/s")
        axis.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--engines", type=int, default=3)
    parser.add_argument("--apps", type=int, default=6)
    parser.add_argument("--prompt-words", type=int, default=800, help="~1,100 tokens with the chat template")
    parser.add_argument("--num-blocks", type=int, default=180, help="16-token KV blocks per engine (~2 prompts)")
    parser.add_argument("--engine-args", default="", help="more `parrot engine` options, e.g. '--dtype bfloat16'")
    parser.add_argument("--rates", type=float, nargs="+", default=[0.5, 1.0, 1.5, 2.0])
    parser.add_argument("--requests", type=int, default=48, help="per run, after one warm-up request per app")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--slo-s", type=float, default=5.0, help="p90 end-to-end latency to stay under")
    parser.add_argument("--policies", nargs="+", default=[*GATEWAY_POLICIES, "vllm-router", "sglang-router"])
    parser.add_argument("--vllm-router", default="vllm-router", help="the vllm-router binary (its own venv)")
    parser.add_argument("--sglang-router", default="python", help="a Python with sglang-router installed")
    parser.add_argument("--vllm-router-args", default="", help="more vllm-router options")
    parser.add_argument("--sglang-router-args", default="", help="more sglang-router options, e.g. '--model-path DIR'")
    parser.add_argument("--rounds", type=int, default=1, help="rounds over the rates, policies alternating; medians")
    parser.add_argument("--sequential", action="store_true",
                        help="send each run's requests one after another (the rate only seeds the trace): the hit "
                             "rate then measures what the policy knows of the caches, not how it weighs queues; "
                             "its latencies are not a timed result")
    parser.add_argument("--keep-engines", action="store_true",
                        help="start the engines once (a loaded host takes minutes to start them) and give each run "
                             "apps of its own instead of empty caches: what earlier runs left is evicted as it goes")
    parser.add_argument("--out", default=str(TRACKED / "multi_engine.json"))
    args = parser.parse_args()

    fleet, apps = Fleet(args), Apps(args)
    rows = []
    print(f"{'rate':>5} {'policy':<14} {'p90 s':>8} {'TTFT s':>8} {'hit rate':>9} {'of best':>8} failed")
    try:
        turn = 0
        for _ in range(args.rounds):
            for rate in args.rates:
                order = args.policies if turn % 2 == 0 else args.policies[::-1]  # alternating rounds
                turn += 1
                for policy in order:
                    if args.keep_engines:
                        apps = Apps(args, first_seed=1000 + 100 * len(rows))
                    row = measure(policy, rate, fleet, apps, args)
                    rows.append(row)
                    print(f"{rate:>5} {policy:<14} {row['p90_s']:>8.2f} {row['mean_ttft_s'] or 0:>8.2f} "
                          f"{row['hit_rate']:>9.3f} {row['of_achievable']:>8.3f} {row['failed']}", flush=True)

    finally:
        fleet.stop()  # (kept running across runs with --keep-engines)

    def median(policy: str, key: str) -> float:
        return statistics.median(r[key] or 0 for r in rows if r["policy"] == policy)

    summary = {policy: {"sustained_rps": sustained(rows, policy, args.slo_s), "hit_rate": median(policy, "hit_rate"),
                        "achievable_hit_rate": median(policy, "achievable_hit_rate"),
                        "of_achievable": median(policy, "of_achievable"), "mean_ttft_s": median(policy, "mean_ttft_s"),
                        "p90_s": median(policy, "p90_s")}
               for policy in args.policies}
    routers = [summary[p]["sustained_rps"] for p in ("vllm-router", "sglang-router") if p in summary]
    print(f"\nsustained rate with p90 under {args.slo_s:g} s; medians over all runs: prefix-hit rate, of the "
          "achievable, TTFT, p90:")
    for policy, figures in summary.items():
        print(f"  {policy:<14} {figures['sustained_rps']:>5} req/s  hit {figures['hit_rate']:.3f} "
              f"({figures['of_achievable']:.3f} of {figures['achievable_hit_rate']:.3f})  "
              f"TTFT {figures['mean_ttft_s']:.2f} s  p90 {figures['p90_s']:.2f} s")
    if "parrot" in summary and "parrot-events" in summary and summary["parrot"]["hit_rate"]:
        print(f"  parrot-events / parrot (mirror): hit rate {summary['parrot-events']['hit_rate'] / summary['parrot']['hit_rate']:.2f}x")
    if routers and max(routers) > 0:
        print(f"  parrot / best cache-aware router: {summary['parrot']['sustained_rps'] / max(routers):.2f}x")
    out = write_results(args.out, {"args": vars(args), "rows": rows, "summary": summary})
    plot(rows, args.policies, args.slo_s, out.with_suffix(".png"))
    print(f"saved {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
