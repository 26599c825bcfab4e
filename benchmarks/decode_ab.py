"""One engine change's effect on decode speed: benchmarks.engine_throughput run from two checkouts (a base and a
change) in alternating rounds, each round its own process, then the median tokens/s of each workload per checkout
and their ratios (change over base: > 1 is faster). Hold the shared lock around it on a shared host.

    flock /tmp/parrot-bench.lock python -m benchmarks.decode_ab --base /work/main --change . --rounds 3 \
        --out docs/benchmarks/sliding_window_decode_ab.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.results_file import write_results

THROUGHPUT = ["-m", "benchmarks.engine_throughput", "--skip-hf", "--quantization", "none", "--only", "single",
              "16x64", "--repeats", "3"]


def one_round(checkout: Path, out: Path) -> dict[str, float]:
    """engine_throughput from ``checkout`` (its code on the path first): tokens/s by workload, the engine's column."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    subprocess.run([sys.executable, *THROUGHPUT, "--out", str(out)], cwd=checkout, env=env, check=True)
    columns = json.loads(out.read_text())["tokens_per_s"]
    return next(column for name, column in columns.items() if name.startswith("ours-"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--base", required=True)
    parser.add_argument("--change", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", required=True)
    args = parser.parse_args()
    checkouts = {"base": Path(args.base).resolve(), "change": Path(args.change).resolve()}
    runs: dict[str, list[dict[str, float]]] = {label: [] for label in checkouts}
    loads = []
    with tempfile.TemporaryDirectory() as scratch:
        for round_index in range(args.rounds):
            for label, checkout in checkouts.items():
                loads.append(os.getloadavg()[0])
                runs[label].append(one_round(checkout, Path(scratch) / f"{label}-{round_index}.json"))
    workloads = list(runs["base"][0])
    medians = {label: {w: statistics.median(run[w] for run in rounds) for w in workloads} for label, rounds in runs.items()}
    ratios = {w: round(medians["change"][w] / medians["base"][w], 3) for w in workloads}
    path = write_results(args.out, {"rounds": runs, "median_tokens_per_s": medians, "change_over_base": ratios,
                                    "load_average_1min": loads, "note": "a shared host: other work ran beside it",
                                    "checkouts": {label: str(p) for label, p in checkouts.items()}})
    print("median tok/s", medians, "change/base", ratios, "->", path)


if __name__ == "__main__":
    main()
