"""How long `parrot engine` takes to serve, eager against compiled (`--compile`) on a warm and on a cold
torch.compile cache: what the compiled default costs a start.

    python -m benchmarks.engine_start [--rounds 3] [--cpu-cores 0-1] [--out docs/benchmarks/engine_start.json]

Each round starts the default model's engine process three ways: ``--no-compile``; ``--compile`` on an empty
cache of the round's own (TORCHINDUCTOR_CACHE_DIR: a fresh folder, as on a first start or after an upgrade of
torch); ``--compile`` again on that cache, now warm. A start is timed from the process's launch to its first 200
on /v1/models; the converted model and the C++ kernels are in their cache for all three. Medians, each round's
seconds, the load average (the host is shared) and the warm cache's size are written to --out.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.gateway_overhead import free_port
from benchmarks.results_file import write_results
from benchmarks.vllm_server import SETTLE_S, launch, stop_group
from engines.builtin.compile_cache import INDUCTOR_CACHE_ENV, compile_cache_dir

LOG = Path("benchmarks/results/engine_start.log")


def start_seconds(flags: list[str], env: dict[str, str]) -> float:
    """Seconds from launching an engine process to its first 200 on /v1/models; the process is then stopped."""
    port = free_port()
    command = [sys.executable, "-m", "gateway.server.cli", "engine", "--port", str(port), *flags]
    started = time.perf_counter()
    process = launch(command, LOG, f"http://127.0.0.1:{port}/v1", "parrot engine", timeout_s=1800, poll_s=0.2, env=env)
    seconds = time.perf_counter() - started
    stop_group(process, 10)
    return seconds


def directory_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--cpu-cores", default="0-1")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    pinned = ["--cpu-cores", args.cpu_cores]
    modes = {"eager": [*pinned, "--no-compile"], "compiled, cold cache": [*pinned, "--compile"],
             "compiled, warm cache": [*pinned, "--compile"]}  # in this order: the cold start warms the cache
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    loads, cache_bytes = [], 0
    for round_ in range(args.rounds):
        with tempfile.TemporaryDirectory(prefix="parrot-compile-cache-") as cache:
            for mode, flags in modes.items():
                time.sleep(SETTLE_S)
                seconds[mode].append(start_seconds(flags, env | {INDUCTOR_CACHE_ENV: cache}))
                loads.append([round(x, 2) for x in os.getloadavg()])
                print(f"round {round_ + 1}: {mode} {seconds[mode][-1]:.1f} s (load {loads[-1][0]})", flush=True)
            cache_bytes = directory_bytes(Path(cache))
    medians = {mode: statistics.median(times) for mode, times in seconds.items()}
    for mode, median in medians.items():
        print(f"{mode:22} median {median:6.1f} s  ({', '.join(f'{s:.1f}' for s in seconds[mode])})")
    print(f"compiled start over eager: warm +{medians['compiled, warm cache'] - medians['eager']:.1f} s, "
          f"cold +{medians['compiled, cold cache'] - medians['eager']:.1f} s; the cache {cache_bytes / 2**20:.0f} MiB")
    if args.out:
        write_results(args.out, {"args": vars(args), "start_s": medians, "rounds_s": seconds, "load_average": loads,
                                 "compile_cache": {"where": str(compile_cache_dir()).replace(str(Path.home()), "~"),
                                                   "bytes": cache_bytes}})


if __name__ == "__main__":
    main()
