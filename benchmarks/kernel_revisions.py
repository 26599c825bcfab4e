"""The C++ CPU kernels (attention, linears) before/after a change, in one process: both builds' calls alternating.

    git worktree add ../before <rev>
    python -m benchmarks.kernel_revisions --before ../before [--dtype bfloat16] [--rounds 200] [--out F.json]

Builds the other checkout's ``kernels/native`` sources with this checkout's flags, loads both libraries and
times SmolLM2's attention layer calls (a 1,000- and a 256-token causal prefill, 15 new tokens over 922 cached,
16 forks decoding over a shared 922-token prefix, 16 decodes over 100 tokens) and a decoder layer's linears at
1, 16, 112 and 1,024 rows (q, k, v, o, the gated MLP's gate and up, down; and the gated one alone; the weights packed once), each round
one call of each build, the order swapped every round; each build's prefill is laid out by its own checkout's cpu_attention.
The run is made twice, in two processes loading the builds in opposite orders (here the library loaded first
ran 3-5% faster in either role), and each case's ratio is the geometric mean of the two passes' medians of
per-round after/before ratios. (``benchmarks.revisions`` does the same for the whole engine.)
"""

from __future__ import annotations

import argparse
import ast
import ctypes
import functools
import importlib.util
import inspect
import json
import math
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

from benchmarks.results_file import write_results
from kernels import cpu_attention, native

KV_HEADS, HEADS, HEAD_DIM, BLOCK = 3, 9, 64, 16  # SmolLM2-135M
HIDDEN, INTERMEDIATE = 576, 1536
LINEAR_ROWS = (1, 16, 112, 1024)  # a decode, a batch of 16 decodes, a short and a full prefill chunk


def build(checkout: Path, into: Path) -> ctypes.CDLL:
    """The checkout's native kernels built as this checkout builds its own (native.FLAGS)."""
    target = into / "before.so"
    sources = sorted(path for path in (checkout / "kernels" / "native").glob("*.cpp") if path.name != "torch_ops.cpp")
    native.compile_sources(native._compiler(), sources, target)  # torch_ops.cpp: the torch operators' own build
    return ctypes.CDLL(str(target))


def module_from(checkout: Path):
    """The checkout's cpu_attention, its tiles sized by its own kernel (its native.py's MAX_GROUP; the rest of
    kernels.native is this checkout's)."""
    spec = importlib.util.spec_from_file_location("before_cpu_attention", checkout / "kernels" / "cpu_attention.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    if hasattr(module, "native_tile_tokens"):  # tiles sized by native.MAX_GROUP (older ones: a constant of their own)
        module.native = types.SimpleNamespace(**vars(native))
        module.native.MAX_GROUP = max_group_of(checkout)
    return module


def max_group_of(checkout: Path):
    """The value the checkout's kernels/native.py assigns MAX_GROUP to by name (a number, or one per dtype in
    the revisions whose cpu_attention has native_tile_tokens)."""
    tree = ast.parse((checkout / "kernels" / "native.py").read_text())
    value = next(node.value for node in ast.walk(tree) if isinstance(node, ast.Assign)
                 and any(isinstance(target, ast.Name) and target.id == "MAX_GROUP" for target in node.targets))
    return eval(compile(ast.Expression(value), "MAX_GROUP", "eval"), {"torch": torch})


def plan(module, tables, cu, lens, dtype):
    """A prefill plan in tiles for the native kernel, by that revision's planner (its keyword changed once)."""
    if "native_dtype" in inspect.signature(module.plan_prefill).parameters:
        return module.plan_prefill(tables, cu, lens, BLOCK, native_dtype=dtype)
    return module.plan_prefill(tables, cu, lens, BLOCK, rows_for_native=True)


def cases(dtype, builds):
    """{case: {build: call}}, every call over the same tensors."""
    g = torch.Generator().manual_seed(0)
    cache = lambda blocks: torch.randn(blocks, BLOCK, KV_HEADS, HEAD_DIM, generator=g).to(dtype)  # noqa: E731
    queries = lambda rows: torch.randn(rows, HEADS, HEAD_DIM, generator=g).to(dtype)  # noqa: E731
    out = {}
    for new, cached in ((1000, 0), (256, 0), (15, 922)):
        blocks = (new + cached) // BLOCK + 2
        k, v, q = cache(blocks), cache(blocks), queries(new)
        tables = torch.arange(blocks, dtype=torch.int32)[None, :]
        cu, lens = torch.tensor([0, new], dtype=torch.int32), torch.tensor([new + cached], dtype=torch.int32)
        out[f"prefill {new} over {cached}"] = {
            name: functools.partial(module.prefill, q, k, v, tables, cu, lens, HEAD_DIM**-0.5,
                                    plan=plan(module, tables, cu, lens, dtype), native=kernels)
            for name, (kernels, module) in builds.items()}
    k, v, q = cache(200), cache(200), queries(16)
    prefix, own = torch.arange(59, dtype=torch.int32)[None, :], torch.stack(
        [torch.arange(100 + 2 * i, 102 + 2 * i, dtype=torch.int32) for i in range(16)])
    shared = (q, k, v, torch.zeros(16, dtype=torch.int32), prefix, torch.tensor([922], dtype=torch.int32), own,
              torch.full((16,), 20, dtype=torch.int32), HEAD_DIM**-0.5)
    out["16 forks over 922 shared + 20 own"] = {
        name: functools.partial(kernels.shared_prefix_decode, *shared) for name, (kernels, _) in builds.items()}
    tables = torch.stack([torch.arange(8 * i, 8 * i + 8, dtype=torch.int32) for i in range(16)])
    lens = torch.full((16,), 100, dtype=torch.int32)
    out["16 decodes over 100"] = {name: functools.partial(kernels.decode, q, k, v, tables, lens, HEAD_DIM**-0.5)
                                  for name, (kernels, _) in builds.items()}
    return out | linear_cases(dtype, builds, g)


def linear_cases(dtype, builds, g):
    """{case: {build: call}}: a decoder layer's linears, the weights packed as this checkout packs them."""
    weight = lambda out_features, in_features: (0.05 * torch.randn(out_features, in_features, generator=g)).to(dtype)  # noqa: E731
    kv = KV_HEADS * HEAD_DIM
    plain = [native.pack_linear(weight(n, k)) for n, k in ((HIDDEN, HIDDEN), (kv, HIDDEN), (kv, HIDDEN), (HIDDEN, HIDDEN))]
    gated, down = native.pack_gated_linear(weight(2 * INTERMEDIATE, HIDDEN)), native.pack_linear(weight(HIDDEN, INTERMEDIATE))

    def layer(kernels, x, hidden):
        for packed in plain:
            kernels.linear(x, packed, None)
        kernels.linear(hidden, down, None)
        kernels.gated_linear(x, gated)

    out = {}
    for rows in LINEAR_ROWS:
        x = torch.randn(rows, HIDDEN, generator=g).to(dtype)
        hidden = torch.randn(rows, INTERMEDIATE, generator=g).to(dtype)
        out[f"a layer's linears, {rows} rows"] = {name: functools.partial(layer, kernels, x, hidden)
                                                  for name, (kernels, _) in builds.items()}
        out[f"the gated MLP linear alone, {rows} rows"] = {name: functools.partial(kernels.gated_linear, x, gated)
                                                           for name, (kernels, _) in builds.items()}
    return out


def one_pass(args) -> dict[str, float]:
    """{case: median after/before over rounds}, the builds loaded in args.load_order."""
    dtype = getattr(torch, args.dtype)
    with tempfile.TemporaryDirectory() as scratch:
        loaded = {}
        for name in args.load_order.split(","):
            loaded[name] = ((native.NativeKernels(build(Path(args.before), Path(scratch))), module_from(Path(args.before)))
                            if name == "before" else (native.library(), cpu_attention))
        ratios = {}
        for case, calls in cases(dtype, loaded).items():
            seconds = {name: [] for name in calls}
            for round_ in range(args.rounds):
                for name in (["before", "after"] if round_ % 2 == 0 else ["after", "before"]):
                    start = time.perf_counter()
                    calls[name]()
                    seconds[name].append(time.perf_counter() - start)
            ratios[case] = statistics.median(a / b for a, b in zip(seconds["after"], seconds["before"]))
        return ratios


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="another checkout of this repository")
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--rounds", type=int, default=200)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", default=None)
    parser.add_argument("--load-order", default=None, help=argparse.SUPPRESS)  # one pass, its ratios as JSON
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.load_order:
        print(json.dumps(one_pass(args)))
        return
    passes = {}
    for order in ("before,after", "after,before"):
        command = [sys.executable, "-m", "benchmarks.kernel_revisions", *sys.argv[1:], "--load-order", order]
        passes[order] = json.loads(subprocess.run(command, capture_output=True, text=True, check=True).stdout)
    combined = {case: math.sqrt(passes["before,after"][case] * passes["after,before"][case]) for case in passes["before,after"]}
    print(f"{args.dtype}, {args.threads} threads, {args.rounds} rounds a pass: after/before time (each load order, combined)")
    for case, ratio in combined.items():
        print(f"  {case:36} {passes['before,after'][case]:.3f}  {passes['after,before'][case]:.3f}  {ratio:.3f}")
    if args.out:
        write_results(args.out, {"dtype": args.dtype, "rounds": args.rounds, "threads": args.threads,
                                 "passes": passes, "after_over_before": combined})


if __name__ == "__main__":
    main()
