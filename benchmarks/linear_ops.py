"""The engine's decode steps with the linears' C++-bodied torch ops against the Python-bodied ones, in one process.

    python -m benchmarks.linear_ops [--dtype bfloat16] [--eager] [--rounds 20] [--out F.json]

Two engines on the same weights: one whose linears call parrot_native::linear / ::gated_linear
(kernels/native/torch_ops.cpp, what the engine uses where they build), one built while
``native_linear.ops()`` answered the Python-bodied parrot:: ops. Each round decodes 20 tokens at batch 1
and at 16 on both, the order alternating; a round's figure is its median step, and each batch size's
ratio is the median of the rounds' C++/Python ratios (paired, as this host's speed moves by 25-50%).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.results_file import write_results  # noqa: E402
from engines.builtin.config import EngineConfig  # noqa: E402
from engines.builtin.core import EngineCore  # noqa: E402
from engines.builtin.types import SamplingParams  # noqa: E402
from kernels import native_linear  # noqa: E402

SIDES = ("cpp", "python")


def python_bodied_engine(config: EngineConfig) -> EngineCore:
    """An engine whose linears took the Python-bodied ops when made (NativeLinear reads ops() then)."""
    ops = native_linear.ops
    native_linear.ops = lambda: (native_linear.native_linear, native_linear.native_gated_linear)
    try:
        return EngineCore(config)
    finally:
        native_linear.ops = ops


class StepTimes:
    """Each step's wall time on one engine."""

    def __init__(self, engine: EngineCore):
        self.times: list[float] = []
        step = engine.step

        def timed():
            start = time.perf_counter()
            try:
                return step()
            finally:
                self.times.append(time.perf_counter() - start)

        engine.step = timed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--eager", action="store_true", help="the eager forward (default: compiled, as served)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    config = EngineConfig(dtype=args.dtype, compile=not args.eager)
    if native_linear.ops()[0] is native_linear.native_linear:
        raise SystemExit("the C++-bodied ops did not build here: nothing to compare")
    engines = {"cpp": EngineCore(config), "python": python_bodied_engine(config)}
    clocks = {side: StepTimes(engine) for side, engine in engines.items()}
    prompt = list(range(100, 140))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    rows = {}
    for batch in (1, 16):
        medians = {side: [] for side in SIDES}
        for round_ in range(args.rounds):
            for side in SIDES if round_ % 2 else reversed(SIDES):
                clocks[side].times.clear()
                engines[side].generate_batch([[i + 5 + round_] + prompt for i in range(batch)], params)
                medians[side].append(statistics.median(clocks[side].times[2:]))  # past the prefill and first decode
        ratio = statistics.median(c / p for c, p in zip(medians["cpp"], medians["python"]))
        rows[f"decode b={batch}"] = {f"{side} ms": statistics.median(medians[side]) * 1e3 for side in SIDES} | {
            "cpp/python": ratio}
        print(f"{args.dtype} {'eager' if args.eager else 'compiled'} decode b={batch}: C++-bodied "
              f"{rows[f'decode b={batch}']['cpp ms']:.2f} ms a step, Python-bodied "
              f"{rows[f'decode b={batch}']['python ms']:.2f}; paired ratio {ratio:.3f}")
    if args.out:
        write_results(args.out, {"dtype": args.dtype, "compiled": not args.eager, "rounds": args.rounds, "rows": rows})
        plot(rows, Path(args.out).with_suffix(".png"))


def plot(rows: dict[str, dict[str, float]], path: Path) -> None:
    """Each batch size's median step on both sides, the paired ratio in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(rows), figsize=(3.2 * len(rows), 3.4))
    for ax, (name, row) in zip(axes, rows.items()):
        bars = ax.bar(range(len(SIDES)), [row[f"{side} ms"] for side in SIDES], color=["tab:green", "tab:grey"])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(SIDES)), ["C++-bodied ops", "Python-bodied ops"], fontsize=7)
        ax.set_title(f"{name}: ms a step (x{row['cpp/python']:.3f})", fontsize=9)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


if __name__ == "__main__":
    main()
