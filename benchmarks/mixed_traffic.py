"""Chat users and background map-reduce jobs on one engine (benchmarks/workloads/mixed.py), side by side.

Modes, alternating per round, each round on fresh arrivals (its own seed) and the same seeds per mode:

- ``parrot``: jobs through the ``parrot`` extension (maps a throughput task group), on `parrot serve`;
- ``plain``: the same traffic as plain requests on the same `parrot serve` (our engine without criteria);
- ``compare``: the same plain traffic on ``--compare-url`` (vLLM-CPU, say, in its default FCFS config).

The builtin engine runs latency-tuned, as the seed paper's baseline did (``--latency-max-num-seqs``: while
latency-critical work runs, at most that many generations a step, latency-critical first); without
criteria every request counts as latency-critical. Printed per mode: chat normalized latency (s per
output token) p50 / p90, map-reduce job completion time, and the ratios to Parrot.

    python -m benchmarks.mixed_traffic --start
    python -m benchmarks.mixed_traffic --start --compare-url http://127.0.0.1:8100/v1 --compare-model DIR
    python -m benchmarks.mixed_traffic --start --start-vllm VENV/bin/python   # vLLM-CPU started here, same precision
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import statistics
from dataclasses import replace
from pathlib import Path
from typing import Iterator

import httpx

from benchmarks.apps import LaunchedGateway, Mode, engine_dtype, served, upstream_config, warm_up
from benchmarks.results_file import TRACKED, write_results, save_figure
from benchmarks.vllm_server import SETTLE_S, LaunchedVLLM
from benchmarks.workloads import mixed


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def measure(args: argparse.Namespace, modes: list[Mode]) -> dict[str, list[dict]]:
    runs: dict[str, list[dict]] = {mode.name: [] for mode in modes}
    cfg = mixed.Config(duration_s=args.duration, chat_sessions_per_s=args.chat_rate, job_interval_s=args.job_interval)
    async with httpx.AsyncClient(timeout=args.timeout) as client:
        for mode in modes:
            await warm_up(client, mode)
        for round_ in range(args.rounds):
            for mode in modes if round_ % 2 == 0 else modes[::-1]:
                await asyncio.sleep(SETTLE_S)  # the previous mode's server may still spin (vllm_server.SETTLE_S)
                async with httpx.AsyncClient(base_url=mode.url, timeout=args.timeout) as mode_client:
                    job = replace(cfg.job, **dict(mode.config))  # a mode's own job settings (its service tier)
                    result = await mixed.run(mode_client, mode.model, replace(cfg, seed=args.seed + round_, job=job),
                                             parrot=mode.parrot)
                row = summary(result) | {"load_average": os.getloadavg()[0]}  # a shared host: its load then
                runs[mode.name].append(row)
                print(f"  round {round_ + 1} {mode.name:<8} chat s/token p50 {row['chat_p50']:.3f} "
                      f"p90 {row['chat_p90']:.3f} ({row['chat_answers']} answers), "
                      f"job {row['job_mean']:.1f} s ({row['jobs']} jobs), run {row['seconds']:.0f} s", flush=True)
    return runs


def summary(result: mixed.MixedResult) -> dict[str, float]:
    return {"chat_p50": percentile(result.chat_normalized_s, 0.5), "chat_p90": percentile(result.chat_normalized_s, 0.9),
            "chat_answers": len(result.chat_normalized_s), "job_mean": statistics.fmean(result.job_seconds),
            "jobs": len(result.job_seconds), "seconds": result.seconds}


def medians(runs: dict[str, list[dict]]) -> dict[str, dict[str, float]]:
    keys = ("chat_p50", "chat_p90", "job_mean")
    return {mode: {k: statistics.median(r[k] for r in rows) for k in keys} for mode, rows in runs.items() if rows}


def plot(table: dict[str, dict[str, float]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (chat, jobs) = plt.subplots(1, 2, figsize=(9, 4))
    modes = list(table)
    width = 0.38
    positions = range(len(modes))
    chat.bar([p - width / 2 for p in positions], [table[m]["chat_p50"] for m in modes], width, label="p50")
    chat.bar([p + width / 2 for p in positions], [table[m]["chat_p90"] for m in modes], width, label="p90")
    chat.set_xticks(list(positions), modes)
    chat.set_ylabel("chat latency per output token (s)")
    chat.legend()
    jobs.bar(modes, [table[m]["job_mean"] for m in modes], color="tab:grey")
    jobs.set_ylabel("map-reduce job completion time (s)")
    figure.suptitle(title, fontsize=9)
    save_figure(figure, path)


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--url", default="http://127.0.0.1:8000/v1", help="a running `parrot serve` (without --start)")
    parser.add_argument("--model", default="SmolLM2-135M-Instruct")
    parser.add_argument("--start", action="store_true", help="launch `parrot serve` here (and stop it at the end)")
    parser.add_argument("--engine-args", default="--latency-max-num-seqs 4", help="with --start: the engine's flags")
    parser.add_argument("--compare-url", default=None, help="another server for the plain traffic (vLLM-CPU)")
    parser.add_argument("--compare-model", default=None, help="its model name (default: --model)")
    parser.add_argument("--start-vllm", metavar="PYTHON",
                        help="compare with vLLM-CPU started here from this venv's python (same weights, the "
                             "precision of --engine-args' --dtype, float32 by default), instead of --compare-url")
    parser.add_argument("--upstream-vllm", metavar="PYTHON",
                        help="Parrot in front of vLLM-CPU started here from this venv's python (`parrot serve "
                             "--no-builtin`, prefill ahead next in line) against the same traffic on that vLLM "
                             "alone (mode compare); --start and --start-vllm are then not used")
    parser.add_argument("--vllm-priority", action="store_true",
                        help="with --upstream-vllm: vLLM runs --scheduling-policy priority and the gateway sends "
                             "criteria as its priority (the compare mode's plain requests all have the default)")
    parser.add_argument("--throughput-hold-s", type=float,
                        help="with --upstream-vllm: the gateway's [scheduler] throughput_hold_s (its default else)")
    parser.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals per run")
    parser.add_argument("--chat-rate", type=float, default=0.25, help="chat sessions arriving per second")
    parser.add_argument("--job-interval", type=float, default=20.0, help="seconds between map-reduce jobs")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=600)
    parser.add_argument("--out", default=str(TRACKED / "mixed_traffic.json"))
    args = parser.parse_args()
    if args.job_interval > args.duration:  # a run has duration // job_interval jobs (workloads/mixed.py)
        parser.error(f"--job-interval {args.job_interval:g} is longer than --duration {args.duration:g}: "
                     "no job would run")
    return args


@contextlib.contextmanager
def compared(args: argparse.Namespace, out: Path) -> Iterator[None]:
    """With ``args.start_vllm``, a vLLM-CPU launched for the run as ``args.compare_url`` (its log beside
    ``out``), stopped at the end."""
    if not args.start_vllm:
        yield
        return
    print("launching vLLM-CPU …", flush=True)
    vllm = LaunchedVLLM(args.start_vllm, engine_dtype(args.engine_args), out.with_suffix(".vllm.log"))
    try:
        args.compare_url, args.compare_model = vllm.url, vllm.model
        yield
    finally:
        vllm.close()


@contextlib.contextmanager
def fronting_vllm(args: argparse.Namespace, out: Path) -> Iterator[list[Mode]]:
    """vLLM launched for the run and `parrot serve` in front of it: the gateway's mode (jobs through the
    extension, chat plain, all through the gateway) and vLLM alone with the same traffic plain (compare)."""
    print("launching vLLM-CPU …", flush=True)
    extra = ("--scheduling-policy", "priority") if args.vllm_priority else ()
    vllm = LaunchedVLLM(args.upstream_vllm, engine_dtype(args.engine_args), out.with_suffix(".vllm.log"),
                        extra_args=extra)
    gateway = None
    try:
        config = upstream_config(vllm, args.model, "next_in_line")
        if args.vllm_priority:
            config += 'priority_scheduling = "lower_first"\n'
        if args.throughput_hold_s is not None:
            config = f"[scheduler]\nthroughput_hold_s = {args.throughput_hold_s}\n" + config
        gateway = LaunchedGateway(args.model, [], out.with_suffix(".serve.log"), 600, config=config)
        yield [Mode("parrot", gateway.url, args.model),  # jobs as the app marks them: its reduce waited on
               Mode("parrot_flex", gateway.url, args.model, (("service_tier", "flex"),)),  # jobs as background work
               Mode("compare", vllm.url, vllm.model)]
    finally:
        if gateway is not None:
            gateway.close()
        vllm.close()


def main() -> None:
    args = parse_args()
    out = Path(args.out)
    if args.upstream_vllm:
        with fronting_vllm(args, out) as modes:
            runs = asyncio.run(measure(args, modes))
    else:
        with compared(args, out), served(args, out) as args.url:
            modes = [Mode("parrot", args.url, args.model), Mode("plain", args.url, args.model)]
            if args.compare_url:
                modes.append(Mode("compare", args.compare_url, args.compare_model or args.model))
            runs = asyncio.run(measure(args, modes))
    table = medians(runs)
    print(f"\nmedians of {args.rounds} rounds ({args.duration:.0f} s of arrivals each):")
    parrot = table["parrot"]
    for mode, row in table.items():
        print(f"  {mode:<8} chat s/token p50 {row['chat_p50']:.3f}  p90 {row['chat_p90']:.3f}  job {row['job_mean']:.1f} s"
              f"   vs parrot: chat p90 {row['chat_p90'] / parrot['chat_p90']:.2f}x, job {row['job_mean'] / parrot['job_mean']:.2f}x")
    write_results(out, {"args": vars(args), "runs": runs, "medians": table})
    plot(table, out.with_suffix(".png"), f"{args.model}, chat {args.chat_rate}/s + a map-reduce every "
                                         f"{args.job_interval:.0f} s; engine {args.engine_args}")
    print(f"saved {out} and {out.with_suffix('.png')}")


if __name__ == "__main__":
    main()
