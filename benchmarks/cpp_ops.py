"""The engine's decode steps with an operator's C++ body (kernels/native/torch_ops.cpp) against its Python one,
in one process.

    python -m benchmarks.cpp_ops [--op linears|attention] [--dtype bfloat16] [--eager] [--rounds 20] [--out F.json]

Two engines on the same weights, one as the engine runs where torch_ops builds, one built with the Python-bodied
operator instead: for ``linears``, parrot_native::linear / ::gated_linear against kernels/native_linear.py's
parrot:: ops (``native_linear.ops()`` answering those while the engine is made); for ``attention`` (compiled
only), the graph's parrot_native::attention against parrot::paged_attention (engines/builtin/compiled_model.py).
Each round decodes 20 tokens at batch 1 and at 16 on both, and 16 forks of a 900-token prompt, the order
alternating; a round's figure is its median step, and each workload's ratio is the median of the rounds'
C++/Python ratios (paired, as this host's speed moves by 25-50%). The two engines' tokens must be equal.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from benchmarks.results_file import save_figure, write_results  # noqa: E402
from engines.builtin.config import EngineConfig  # noqa: E402
from engines.builtin.core import EngineCore  # noqa: E402
from engines.builtin.types import SamplingParams  # noqa: E402
from kernels import native, native_linear  # noqa: E402

SIDES = ("cpp", "python")


def python_bodied_engine(config: EngineConfig, op: str) -> EngineCore:
    """An engine made with the Python-bodied operator: its linears take ops() when made, its compiled forward
    is told whether its attention is the C++ operator's."""
    if op == "linears":
        ops = native_linear.ops
        native_linear.ops = lambda: (native_linear.native_linear, native_linear.native_gated_linear)
        try:
            return EngineCore(config)
        finally:
            native_linear.ops = ops
    from engines.builtin.compiled_model import CompiledForward

    made = CompiledForward.__init__
    CompiledForward.__init__ = lambda self, model, native_attention=False: made(self, model, False)
    try:
        return EngineCore(config)
    finally:
        CompiledForward.__init__ = made


def workloads() -> dict:
    """Each workload's prompts for a round (new ones each round: no prefix-cache hit but the forks' shared prompt)."""
    prompt, document = list(range(100, 140)), list(range(200, 1100))
    return {
        "decode b=1": lambda round_: [[5 + round_] + prompt],
        "decode b=16": lambda round_: [[i + 5 + round_] + prompt for i in range(16)],
        "16 forks of 900 tokens": lambda round_: [document + [5 + round_, i + 5] for i in range(16)],
    }


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
    parser.add_argument("--op", default="linears", choices=["linears", "attention"])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    parser.add_argument("--eager", action="store_true", help="the eager forward (default: compiled, as served)")
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()

    if args.op == "attention" and args.eager:
        raise SystemExit("the attention operator is the compiled graph's: drop --eager")
    config = EngineConfig(dtype=args.dtype, compile=not args.eager)
    if not native.torch_ops():
        raise SystemExit("the C++-bodied ops did not build here: nothing to compare")
    engines = {"cpp": EngineCore(config), "python": python_bodied_engine(config, args.op)}
    clocks = {side: StepTimes(engine) for side, engine in engines.items()}
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True)
    rows = {}
    for name, prompts in workloads().items():
        medians = {side: [] for side in SIDES}
        for round_ in range(args.rounds):
            tokens = {}
            for side in SIDES if round_ % 2 else reversed(SIDES):
                clocks[side].times.clear()
                tokens[side] = engines[side].generate_batch(prompts(round_), params)
                medians[side].append(statistics.median(clocks[side].times[2:]))  # past the prefill and first decode
            if tokens["cpp"] != tokens["python"]:
                raise SystemExit(f"{name}: the two engines' tokens differ")
        ratio = statistics.median(c / p for c, p in zip(medians["cpp"], medians["python"]))
        rows[name] = {f"{side} ms": statistics.median(medians[side]) * 1e3 for side in SIDES} | {"cpp/python": ratio}
        print(f"{args.op}, {args.dtype} {'eager' if args.eager else 'compiled'}, {name}: C++-bodied "
              f"{rows[name]['cpp ms']:.2f} ms a step, Python-bodied {rows[name]['python ms']:.2f}; paired ratio {ratio:.3f}")
    if args.out:
        write_results(args.out, {"op": args.op, "dtype": args.dtype, "compiled": not args.eager, "rounds": args.rounds,
                                 "rows": rows})
        plot(rows, Path(args.out).with_suffix(".png"))


def plot(rows: dict[str, dict[str, float]], path: Path) -> None:
    """Each batch size's median step on both sides, the paired ratio in the title."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(rows), figsize=(3.4 * len(rows), 3.4))
    for ax, (name, row) in zip(axes, rows.items()):
        bars = ax.bar(range(len(SIDES)), [row[f"{side} ms"] for side in SIDES], color=["tab:green", "tab:grey"])
        ax.bar_label(bars, fmt="%.1f", fontsize=7)
        ax.set_xticks(range(len(SIDES)), ["C++-bodied ops", "Python-bodied ops"], fontsize=7)
        ax.set_title(f"{name}: ms a step (x{row['cpp/python']:.3f})", fontsize=8)
    save_figure(figure, path)


if __name__ == "__main__":
    main()
