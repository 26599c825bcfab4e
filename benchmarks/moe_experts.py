"""A mixture-of-experts layer's routed experts: grouped matmuls over tokens sorted by expert (what the engine runs,
engines/builtin/model.py ``grouped_experts``) against a loop of two matmuls per active expert (transformers'
way, ``looped_experts``), in one process.

    python -m benchmarks.moe_experts [--rounds 15] [--threads N]

Random fp32 weights of a down-scaled Qwen3-MoE layer (64 experts of 512 over a 1,024-wide hidden state, 8 a
token), and a router's top-8 over random logits, for 1, 16 and 256 tokens (a decode, a batch of decodes, a
prefill chunk). Each round times both (the fastest of several calls each), alternating which goes first; a figure
is the median over rounds of the per-round time ratio grouped / looped (paired: this host's speed moves between
rounds). Both must agree.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

from engines.builtin.model import grouped_experts, looped_experts

EXPERTS, HIDDEN, INTERMEDIATE, TOP_K = 64, 1024, 512, 8
TOKEN_COUNTS = (1, 16, 256)


def timed(function, *args, repeats: int) -> float:
    """The fastest of ``repeats`` calls: other work on a shared host only ever adds time."""
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        function(*args)
        best = min(best, time.perf_counter() - start)
    return best


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    gate_up = torch.randn(EXPERTS, 2 * INTERMEDIATE, HIDDEN) * 0.02
    down = torch.randn(EXPERTS, HIDDEN, INTERMEDIATE) * 0.02
    print(f"{EXPERTS} experts, hidden {HIDDEN}, expert width {INTERMEDIATE}, top-{TOP_K}, fp32, {args.threads} threads")
    for tokens in TOKEN_COUNTS:
        x = torch.randn(tokens, HIDDEN)
        weights, chosen = torch.softmax(torch.randn(tokens, EXPERTS), -1).topk(TOP_K, dim=-1)
        inputs = (x, chosen, weights, gate_up, down, F.silu)
        torch.testing.assert_close(grouped_experts(*inputs), looped_experts(*inputs), rtol=1e-4, atol=1e-5)
        repeats = max(3, 32 // tokens)
        ratios, grouped_times, looped_times = [], [], []
        with torch.inference_mode():
            for round_index in range(args.rounds):
                order = (grouped_experts, looped_experts) if round_index % 2 else (looped_experts, grouped_experts)
                times = {function: timed(function, *inputs, repeats=repeats) for function in order}
                grouped_times.append(times[grouped_experts])
                looped_times.append(times[looped_experts])
                ratios.append(times[grouped_experts] / times[looped_experts])
        print(f"{tokens:4d} tokens ({len(chosen.unique())} experts active): grouped "
              f"{statistics.median(grouped_times) * 1e3:7.2f} ms, looped {statistics.median(looped_times) * 1e3:7.2f} ms, "
              f"grouped/looped {statistics.median(ratios):.2f}x the time "
              f"(rounds {min(ratios):.2f}-{max(ratios):.2f})")


if __name__ == "__main__":
    main()
