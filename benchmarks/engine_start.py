"""How long `parrot engine` takes to serve, eager against compiled (`--compile`) on a warm and on a cold
torch.compile cache: what the compiled default costs a start.

    python -m benchmarks.engine_start [--rounds 3] [--cpu-cores 0-1] [--out docs/benchmarks/engine_start.json]

Each round starts the default model's engine process three ways, in turn (each round the other way round):
``--no-compile``; ``--compile`` with inductor's cache where the engine keeps it (warmed by a start before the
rounds); ``--compile`` with an empty cache of its own (TORCHINDUCTOR_CACHE_DIR: a fresh folder, as after an
upgrade of torch or a first start). A start is timed from the process's launch to its first 200 on /v1/models;
the converted model and the C++ kernels are in their cache for all three. Medians, each round's seconds, the
load average (the host is shared) and the warm cache's size are written to --out.
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
    start_seconds([*pinned, "--compile"], env)  # the warm cache: whatever the engine keeps, filled if empty
    modes = {"eager": [*pinned, "--no-compile"], "compiled, warm cache": [*pinned, "--compile"],
             "compiled, cold cache": [*pinned, "--compile"]}
    seconds: dict[str, list[float]] = {mode: [] for mode in modes}
    loads = []
    for round_ in range(args.rounds):
        for mode in list(modes) if round_ % 2 == 0 else list(modes)[::-1]:
            time.sleep(SETTLE_S)
            if mode.endswith("cold cache"):
                with tempfile.TemporaryDirectory(prefix="parrot-cold-") as empty:
                    seconds[mode].append(start_seconds(modes[mode], env | {INDUCTOR_CACHE_ENV: empty}))
            else:
                seconds[mode].append(start_seconds(modes[mode], env))
            loads.append([round(x, 2) for x in os.getloadavg()])
            print(f"round {round_ + 1}: {mode} {seconds[mode][-1]:.1f} s (load {loads[-1][0]})", flush=True)
    medians = {mode: statistics.median(times) for mode, times in seconds.items()}
    cache = compile_cache_dir()
    for mode, median in medians.items():
        print(f"{mode:22} median {median:6.1f} s  ({', '.join(f'{s:.1f}' for s in seconds[mode])})")
    print(f"compiled start over eager: warm +{medians['compiled, warm cache'] - medians['eager']:.1f} s, "
          f"cold +{medians['compiled, cold cache'] - medians['eager']:.1f} s; cache {cache}")
    if args.out:
        write_results(args.out, {"args": vars(args), "start_s": medians, "rounds_s": seconds, "load_average": loads,
                                 "compile_cache": {"where": str(cache).replace(str(Path.home()), "~"),
                                                   "bytes": directory_bytes(cache)}})


if __name__ == "__main__":
    main()
