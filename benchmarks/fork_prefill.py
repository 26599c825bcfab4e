"""A step of forks' first chunks over a shared prompt: one attention call with their prefixes shared, against one
with each chunk over its own, in one process.

    python -m benchmarks.fork_prefill [--dtype bfloat16] [--new 3 20] [--rounds 300] [--out F.json]

16 forks of a ~900-token prompt (896 tokens in whole blocks that all their tables share, then each fork's copy of
the last 4 and its new tokens), each with a chunk of --new tokens, laid out as the engine lays out a step
(``cpu_attention.join_rows``, which gives prefixes over the same blocks one id) and as it did before
(``concatenated_rows``: each chunk's tiles with prefix ids of their own); SmolLM2's heads, one C++ kernel call a
layer. Each round calls both layouts, the order alternating; the ratio is the median of the rounds' shared/apart
ratios. The outputs must be equal within rounding.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from benchmarks.kernel_revisions import BLOCK, HEAD_DIM, HEADS, KV_HEADS  # SmolLM2-135M's attention
from benchmarks.results_file import write_results
from kernels import cpu_attention, native

FORKS, SHARED_BLOCKS = 16, 56


def layouts(new: int, dtype: torch.dtype):
    """{layout: prepared call}, the queries, and the caches, over the same tensors."""
    g = torch.Generator().manual_seed(0)
    own_blocks = -(-(4 + new) // BLOCK)
    blocks = SHARED_BLOCKS + FORKS * own_blocks
    k, v = (torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    shared = torch.arange(SHARED_BLOCKS, dtype=torch.int32)
    own = [torch.arange(own_blocks, dtype=torch.int32) + SHARED_BLOCKS + i * own_blocks for i in range(FORKS)]
    tables = torch.stack([torch.cat([shared, blocks_of_fork]) for blocks_of_fork in own])
    context = torch.full((FORKS,), SHARED_BLOCKS * BLOCK + 4 + new, dtype=torch.int32)
    cu = torch.arange(0, (FORKS + 1) * new, new, dtype=torch.int32)
    q = torch.randn(FORKS * new, HEADS, HEAD_DIM, generator=g).to(dtype)
    plan = cpu_attention.plan_prefill(tables, cu, context, BLOCK, native_dtype=dtype)
    parts = [chunk.cached_rows for chunk in plan]
    rows = {"shared": cpu_attention.join_rows(parts, BLOCK), "apart": cpu_attention.concatenated_rows(parts)}
    assert rows["shared"].prefix_ids.unique().numel() < rows["apart"].prefix_ids.unique().numel()
    kernels = native.library()
    calls = {name: kernels.prepare_decode(r.own_tables, r.own_lens, (r.prefix_ids, r.prefix_table, r.prefix_len))
             for name, r in rows.items()}
    return calls, q, k, v


def measure(new: int, dtype: torch.dtype, rounds: int) -> dict:
    calls, q, k, v = layouts(new, dtype)
    outs = {name: call(q, k, v, HEAD_DIM**-0.5).float() for name, call in calls.items()}
    torch.testing.assert_close(outs["shared"], outs["apart"], rtol=1e-2, atol=1e-2)
    seconds = {name: [] for name in calls}
    for round_ in range(rounds):
        for name in (["shared", "apart"] if round_ % 2 else ["apart", "shared"]):
            start = time.perf_counter()
            calls[name](q, k, v, HEAD_DIM**-0.5)
            seconds[name].append(time.perf_counter() - start)
    return {"shared_us": statistics.median(seconds["shared"]) * 1e6,
            "apart_us": statistics.median(seconds["apart"]) * 1e6,
            "ratio": statistics.median(a / b for a, b in zip(seconds["shared"], seconds["apart"]))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--new", nargs="+", type=int, default=[3, 20], help="each fork's new tokens")
    parser.add_argument("--rounds", type=int, default=300)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    results = {}
    print(f"{FORKS} forks' chunks over {SHARED_BLOCKS * BLOCK} shared tokens, {torch.get_num_threads()} threads, "
          f"median of {args.rounds} alternating rounds")
    for dtype in args.dtype:
        for new in args.new:
            figures = results[f"{dtype} {new} new"] = measure(new, getattr(torch, dtype), args.rounds)
            print(f"  {dtype:9} {new:3} new tokens a fork: shared {figures['shared_us']:7.0f} us, apart "
                  f"{figures['apart_us']:7.0f} us, shared/apart {figures['ratio']:.3f}x the time")
    if args.out:
        write_results(args.out, {"threads": torch.get_num_threads(), "rounds": args.rounds, "results": results})


if __name__ == "__main__":
    main()
