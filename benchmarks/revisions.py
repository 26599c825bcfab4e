"""Before/after a change, in one run: the engine's throughput for two checkouts, alternating rounds.

    git worktree add ../before <rev>
    python -m benchmarks.revisions --before ../before --rounds 3 -- --skip-hf --quantization none

(The gateway's overhead has this built in: ``gateway_overhead --compare-url`` measures a gateway started
from the other checkout in the same rounds.)

``--before`` is another checkout of this repository (e.g. ``git worktree add ../before <rev>``), run with
this venv's Python from its own directory, so each round imports that checkout's code. Each round runs the
benchmark once per checkout (the order alternating), reads the figures it prints, and the medians over
rounds are printed side by side with their ratio (and written to ``--out`` as JSON).
``benchmarks.engine_throughput`` runs the engine in its own process each time, so a round is a cold
start: the model load is outside its timings.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
from pathlib import Path

# How each benchmark's printed figures are read: {figure name: value}.
_ENGINE_ROW = re.compile(r"^(single|16x64|shared)\s+([\d.]+)", re.M)  # the first column: ours, tok/s


def engine_figures(output: str) -> dict[str, float]:
    return {f"{workload} tok/s": float(rate) for workload, rate in _ENGINE_ROW.findall(output)}


def run_once(checkout: Path, extra: list[str]) -> dict[str, float]:
    command = [sys.executable, "-m", "benchmarks.engine_throughput", *extra]
    done = subprocess.run(command, cwd=checkout, capture_output=True, text=True, check=True)
    return engine_figures(done.stdout)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, type=Path, help="the other checkout")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("extra", nargs=argparse.REMAINDER, help="after --: engine_throughput's own arguments")
    args = parser.parse_args()
    extra = [a for a in args.extra if a != "--"]
    checkouts = {"before": args.before.resolve(), "after": Path.cwd()}
    rounds: dict[str, list[dict[str, float]]] = {"before": [], "after": []}
    for i in range(args.rounds):
        order = ["before", "after"] if i % 2 == 0 else ["after", "before"]
        for name in order:
            figures = run_once(checkouts[name], extra)
            rounds[name].append(figures)
            print(f"round {i + 1} {name}: {figures}", flush=True)
    keys = sorted(set(rounds["before"][0]) & set(rounds["after"][0]))
    medians = {name: {k: statistics.median(r[k] for r in rounds[name]) for k in keys} for name in rounds}
    print(f"\n{'figure':48}{'before':>12}{'after':>12}{'after/before':>14}")
    for key in keys:
        before, after = medians["before"][key], medians["after"][key]
        print(f"{key:48}{before:12.3f}{after:12.3f}{after / before if before else float('nan'):14.3f}")
    if args.out:
        args.out.write_text(json.dumps({"benchmark": "engine_throughput", "arguments": extra, "rounds": rounds,
                                        "medians": medians, "command": " ".join(sys.argv)}, indent=1))


if __name__ == "__main__":
    main()
