"""Attention kernel benchmark: Triton kernels vs torch SDPA and each other, with achieved bandwidth.

    python benchmarks/kernels.py                 # CUDA: the kernel tables below
    python benchmarks/kernels.py --peak-tbps 2.0 # override the HBM peak looked up from the device name
    python benchmarks/kernels.py --cpu           # the CPU dispatch paths and the alternatives they beat

On a machine without CUDA it runs the CPU comparison (small shapes) and says the GPU tables need CUDA.
Figures are medians; bandwidth counts the bytes a kernel must move at least (KV read once, q and
out once), so a fraction of peak near 1 means the kernel is memory-bound and close to optimal.

Targets: paged decode >= 1.0x SDPA on contiguous KV and >= 70% of HBM peak at large batch;
shared-prefix decode >= 2x paged decode at 64 sequences sharing a 4k-token prefix.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.machine_limits import median_seconds  # noqa: E402
from kernels import cpu_attention, native  # noqa: E402

PEAK_TBPS = {"H200": 4.8, "H100 PCIe": 2.0, "H100": 3.35, "A100": 2.0, "L40S": 0.864, "A10": 0.6, "4090": 1.0}
SMOLLM2 = dict(num_heads=9, num_kv_heads=3, head_dim=64)
LLAMA8B = dict(num_heads=32, num_kv_heads=8, head_dim=128)


def peak_tbps(override: float | None) -> float:
    if override:
        return override
    name = torch.cuda.get_device_name()
    for key, tbps in PEAK_TBPS.items():
        if key in name:
            return tbps
    raise SystemExit(f"unknown HBM peak for {name!r}; pass --peak-tbps")


def paged_batch(batch, context, num_heads, num_kv_heads, head_dim, block_size=16, dtype=torch.bfloat16, device="cuda"):
    """Every sequence `context` tokens long, its blocks shuffled across the cache."""
    blocks_per_seq = -(-context // block_size)
    k_cache = torch.randn(batch * blocks_per_seq, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    v_cache = torch.randn_like(k_cache)
    tables = torch.randperm(batch * blocks_per_seq, device=device).view(batch, blocks_per_seq).int()
    lens = torch.full((batch,), context, dtype=torch.int32, device=device)
    q = torch.randn(batch, num_heads, head_dim, dtype=dtype, device=device)
    return q, k_cache, v_cache, tables, lens


def gpu_ms(fn) -> float:
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def row(label: str, ms: float, nbytes: float, peak: float, baseline_ms: float | None = None) -> None:
    tbps = nbytes / ms / 1e9
    ratio = f"  {baseline_ms / ms:5.2f}x vs baseline" if baseline_ms else ""
    print(f"  {label:<44} {ms * 1e3:9.1f} us  {tbps:6.2f} TB/s  {tbps / peak:6.1%} of peak{ratio}")


def bench_decode(peak: float) -> None:
    from kernels.paged_decode import paged_decode

    print("paged decode (bf16, block 16) vs SDPA on contiguous KV")
    for shape_name, shape in (("SmolLM2", SMOLLM2), ("Llama-8B", LLAMA8B)):
        for batch, context in ((1, 4096), (16, 2048), (64, 2048), (256, 1024), (128, 4096)):
            q, k_cache, v_cache, tables, lens = paged_batch(batch, context, **shape)
            scale = shape["head_dim"] ** -0.5
            dense_k = torch.randn(batch, shape["num_kv_heads"], context, shape["head_dim"], dtype=q.dtype, device="cuda")
            dense_v = torch.randn_like(dense_k)
            sdpa_ms = gpu_ms(lambda: F.scaled_dot_product_attention(q.unsqueeze(2), dense_k, dense_v, scale=scale, enable_gqa=True))
            paged_ms = gpu_ms(lambda: paged_decode(q, k_cache, v_cache, tables, lens, scale))
            nbytes = 2 * dense_k.numel() * dense_k.element_size() + 2 * q.numel() * q.element_size()
            label = f"{shape_name} B={batch} L={context}"
            row(label + " SDPA", sdpa_ms, nbytes, peak)
            row(label + " paged", paged_ms, nbytes, peak, sdpa_ms)
            del k_cache, v_cache, dense_k, dense_v


def bench_prefill(peak: float) -> None:
    from kernels.paged_prefill import paged_prefill

    print("paged prefill (bf16, block 16) vs SDPA causal on contiguous KV (TFLOP/s in place of bandwidth)")
    for shape_name, shape in (("SmolLM2", SMOLLM2), ("Llama-8B", LLAMA8B)):
        for batch, length in ((1, 4096), (8, 1024), (32, 512)):
            _, k_cache, v_cache, tables, lens = paged_batch(batch, length, **shape)
            q = torch.randn(batch * length, shape["num_heads"], shape["head_dim"], dtype=k_cache.dtype, device="cuda")
            cu = torch.arange(0, batch + 1, device="cuda", dtype=torch.int32) * length
            scale = shape["head_dim"] ** -0.5
            dense_q = q.view(batch, length, shape["num_heads"], -1).transpose(1, 2)
            dense_k = torch.randn(batch, shape["num_kv_heads"], length, shape["head_dim"], dtype=q.dtype, device="cuda")
            sdpa_ms = gpu_ms(lambda: F.scaled_dot_product_attention(dense_q, dense_k, dense_k, is_causal=True, scale=scale, enable_gqa=True))
            paged_ms = gpu_ms(lambda: paged_prefill(q, k_cache, v_cache, tables, cu, lens, length, scale))
            flops = 2 * 2 * batch * shape["num_heads"] * length * length * shape["head_dim"] / 2  # causal half
            label = f"{shape_name} B={batch} L={length}"
            print(f"  {label + ' SDPA':<44} {sdpa_ms * 1e3:9.1f} us  {flops / sdpa_ms / 1e9:7.1f} TFLOP/s")
            print(f"  {label + ' paged':<44} {paged_ms * 1e3:9.1f} us  {flops / paged_ms / 1e9:7.1f} TFLOP/s"
                  f"  {sdpa_ms / paged_ms:5.2f}x vs SDPA")


def bench_kv_write(peak: float) -> None:
    from kernels.kv_write import kv_write

    print("kv_write (bf16, block 16): bytes = read K,V + write K,V")
    for shape_name, shape in (("SmolLM2", SMOLLM2), ("Llama-8B", LLAMA8B)):
        for tokens in (256, 8192):
            _, k_cache, v_cache, _, _ = paged_batch(tokens // 16, 16, **shape)
            key = torch.randn(tokens, shape["num_kv_heads"], shape["head_dim"], dtype=k_cache.dtype, device="cuda")
            slots = torch.randperm(tokens, device="cuda")
            ms = gpu_ms(lambda: kv_write(key, key, k_cache, v_cache, slots))
            row(f"{shape_name} T={tokens}", ms, 4 * key.numel() * key.element_size(), peak)


def bench_shared_prefix(peak: float, prefix_len: int = 4096, sequences: int = 64, suffix_len: int = 128) -> None:
    from kernels.paged_decode import paged_decode
    from kernels.shared_prefix_decode import shared_prefix_decode

    print(f"shared-prefix decode vs paged decode: {sequences} sequences sharing a {prefix_len}-token prefix, "
          f"{suffix_len}-token suffixes (bf16, block 16)")
    for shape_name, shape in (("SmolLM2", SMOLLM2), ("Llama-8B", LLAMA8B)):
        block = 16
        prefix_blocks, suffix_blocks = prefix_len // block, -(-suffix_len // block)
        num_blocks = prefix_blocks + sequences * suffix_blocks
        k_cache = torch.randn(num_blocks, block, shape["num_kv_heads"], shape["head_dim"], dtype=torch.bfloat16, device="cuda")
        v_cache = torch.randn_like(k_cache)
        order = torch.randperm(num_blocks, device="cuda").int()
        prefix_table = order[:prefix_blocks].view(1, -1)
        suffix_tables = order[prefix_blocks:].view(sequences, -1)
        joined = torch.cat([prefix_table.expand(sequences, -1), suffix_tables], dim=1).contiguous()
        q = torch.randn(sequences, shape["num_heads"], shape["head_dim"], dtype=torch.bfloat16, device="cuda")
        scale = shape["head_dim"] ** -0.5
        prefix_ids = torch.zeros(sequences, dtype=torch.int32, device="cuda")
        prefix_lens = torch.tensor([prefix_len], dtype=torch.int32, device="cuda")
        suffix_lens = torch.full((sequences,), suffix_len, dtype=torch.int32, device="cuda")
        total_lens = suffix_lens + prefix_len

        paged_ms = gpu_ms(lambda: paged_decode(q, k_cache, v_cache, joined, total_lens, scale))
        shared_ms = gpu_ms(lambda: shared_prefix_decode(q, k_cache, v_cache, prefix_ids, prefix_table, prefix_lens,
                                                        suffix_tables, suffix_lens, scale))
        out_shared = shared_prefix_decode(q, k_cache, v_cache, prefix_ids, prefix_table, prefix_lens, suffix_tables, suffix_lens, scale)
        out_paged = paged_decode(q, k_cache, v_cache, joined, total_lens, scale)
        err = (out_shared.float() - out_paged.float()).abs().max().item()
        token_bytes = 2 * shape["num_kv_heads"] * shape["head_dim"] * 2
        paged_bytes = sequences * (prefix_len + suffix_len) * token_bytes
        shared_bytes = (prefix_len + sequences * suffix_len) * token_bytes
        row(f"{shape_name} paged (re-reads the prefix)", paged_ms, paged_bytes, peak)
        row(f"{shape_name} shared-prefix (max |diff| {err:.1e})", shared_ms, shared_bytes, peak, paged_ms)


def cpu_ms(fn, repeats: int = 15) -> float:
    return median_seconds(fn, repeats) * 1e3


def decode_sdpa_loop(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Alternative: one SDPA call per sequence over its gathered KV."""
    return cpu_attention.decode_per_sequence(q, k_cache, v_cache, block_tables, context_lens, scale, torch.zeros_like(q))


def decode_padded_sdpa(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Alternative: one masked SDPA call over the padded batch (what dispatch uses for fp32)."""
    return cpu_attention.decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, torch.zeros_like(q))


def decode_einsum(q, k_cache, v_cache, block_tables, context_lens, scale):
    """Alternative: padded gather with a hand-written grouped softmax."""
    max_len = int(context_lens.max())
    k = cpu_attention.gather_padded(k_cache, block_tables, max_len)
    v = cpu_attention.gather_padded(v_cache, block_tables, max_len)
    batch, num_heads, head_dim = q.shape
    grouped = q.view(batch, k.shape[1], -1, head_dim)
    out, _ = cpu_attention.attend_with_lse(grouped, k, v, scale, cpu_attention.length_mask(context_lens, max_len)[:, None, None, :])
    return out.reshape(batch, num_heads, head_dim).to(q.dtype)


def decode_layers_planned(args, layers: int) -> list[torch.Tensor]:
    q, k_cache, v_cache, tables, lens, scale = args
    plan = cpu_attention.plan_decode(tables, lens, k_cache.shape[1])
    return [cpu_attention.decode(*args, plan=plan) for _ in range(layers)]


def bench_cpu() -> None:
    cpp = native.library()  # what dispatch runs for CPU decode where it builds (kernels/native.py)
    assert cpp is not None, "the C++ kernels did not build here (see the warning above)"
    print(f"CPU dispatch paths (SmolLM2 heads, block 16, {torch.get_num_threads()} threads), median ms; "
          "'torch' is the torch path dispatch falls back to without the C++ kernels")
    for dtype in (torch.float32, torch.bfloat16):
        for batch, context in ((1, 512), (8, 512), (16, 2048)):
            q, k_cache, v_cache, tables, _ = paged_batch(batch, context, **SMOLLM2, dtype=dtype, device="cpu")
            lens = torch.randint(context // 2, context + 1, (batch,), dtype=torch.int32)
            args = (q, k_cache, v_cache, tables, lens, 0.125)
            in_cpp = cpu_ms(lambda: cpp.decode(*args))
            chosen = cpu_ms(lambda: cpu_attention.decode(*args))
            padded = cpu_ms(lambda: decode_padded_sdpa(*args))
            loop = cpu_ms(lambda: decode_sdpa_loop(*args))
            einsum = cpu_ms(lambda: decode_einsum(*args))
            print(f"  decode {str(dtype):<15} B={batch:<3} L<={context:<5} C++ {in_cpp:7.2f}   torch {chosen:7.2f}"
                  f"   padded SDPA {padded:7.2f}   per-seq SDPA {loop:7.2f}   padded einsum {einsum:7.2f}"
                  f"   (torch / C++ {chosen / in_cpp:4.2f}x)")
    for dtype in (torch.float32, torch.bfloat16):  # one sequence's prefill chunk: new tokens over cached ones
        for new, cached in ((1000, 0), (512, 512), (64, 900)):
            q, k_cache, v_cache, tables, _ = paged_batch(1, new + cached, **SMOLLM2, dtype=dtype, device="cpu")
            q = torch.randn(new, SMOLLM2["num_heads"], SMOLLM2["head_dim"], dtype=dtype)
            cu, lens = torch.tensor([0, new], dtype=torch.int32), torch.tensor([new + cached], dtype=torch.int32)
            tiled = cpu_attention.plan_prefill(tables, cu, lens, 16, native_dtype=dtype)
            sdpa = cpu_attention.plan_prefill(tables, cu, lens, 16)
            in_cpp = cpu_ms(lambda: cpu_attention.prefill(q, k_cache, v_cache, tables, cu, lens, 0.125, plan=tiled,
                                                          native=cpp))
            in_torch = cpu_ms(lambda: cpu_attention.prefill(q, k_cache, v_cache, tables, cu, lens, 0.125, plan=sdpa))
            print(f"  prefill {str(dtype):<15} {new} new over {cached} cached: C++ tiles {in_cpp:7.2f}   "
                  f"torch SDPA {in_torch:7.2f}   (torch / C++ {in_torch / in_cpp:4.2f}x)")
    for batch in (1, 16):  # a decode step's attention over SmolLM2's 30 layers: reads planned once, or per call
        q, k_cache, v_cache, tables, _ = paged_batch(batch, 256, **SMOLLM2, dtype=torch.bfloat16, device="cpu")
        lens = torch.randint(128, 257, (batch,), dtype=torch.int32)
        args = (q, k_cache, v_cache, tables, lens, 0.125)
        per_call = cpu_ms(lambda: [cpu_attention.decode(*args) for _ in range(30)])
        once = cpu_ms(lambda: decode_layers_planned(args, layers=30))
        print(f"  decode step, 30 layers, bf16 B={batch:<3} L<=256: plan per call {per_call:7.2f}   "
              f"one plan {once:7.2f}   ({per_call / once:4.2f}x)")
    for sequences, prefix_len, dtype in ((16, 1024, torch.float32), (64, 1024, torch.float32), (4, 1024, torch.float32),
                                         (16, 1024, torch.bfloat16), (4, 1024, torch.bfloat16)):
        # 16 and 4 sequences: their suffixes go through one masked call with the prefix; 64: too many
        q, k_cache, v_cache, suffix_tables, _ = paged_batch(sequences, 64, **SMOLLM2, dtype=dtype, device="cpu")
        prefix_blocks = prefix_len // 16
        k_prefix = torch.randn(prefix_blocks, 16, 3, 64, dtype=dtype)
        k_cache, v_cache = torch.cat([k_cache, k_prefix]), torch.cat([v_cache, k_prefix])
        prefix_table = torch.arange(len(k_cache) - prefix_blocks, len(k_cache), dtype=torch.int32)[None]
        suffix_lens = torch.full((sequences,), 64, dtype=torch.int32)
        joined = torch.cat([prefix_table.expand(sequences, -1), suffix_tables], dim=1)
        args = (q, k_cache, v_cache, torch.zeros(sequences, dtype=torch.int32), prefix_table,
                torch.tensor([prefix_len], dtype=torch.int32), suffix_tables, suffix_lens, 0.125)
        plan = cpu_attention.plan_shared_prefix(*args[3:8], 16, query_group=SMOLLM2["num_heads"] // SMOLLM2["num_kv_heads"])
        two_pass = dataclasses.replace(plan, groups=[dataclasses.replace(g, joined=None) for g in plan.groups])
        shared = cpu_ms(lambda: cpu_attention.shared_prefix_decode(*args, plan=plan))
        separate = cpu_ms(lambda: cpu_attention.shared_prefix_decode(*args, plan=two_pass))
        plain = cpu_ms(lambda: cpu_attention.decode(q, k_cache, v_cache, joined, suffix_lens + prefix_len, 0.125))
        cpp_shared = cpu_ms(lambda: cpp.shared_prefix_decode(*args))
        cpp_plain = cpu_ms(lambda: cpp.decode(q, k_cache, v_cache, joined, suffix_lens + prefix_len, 0.125))
        path = "one masked call" if plan.groups[0].joined is not None else "prefix + suffix"
        print(f"  shared-prefix {str(dtype):<15} {sequences} seqs x {prefix_len}-token prefix: C++ shared {cpp_shared:7.2f}"
              f"   C++ over joined tables {cpp_plain:7.2f}   torch shared ({path}) {shared:7.2f}"
              f"   prefix + suffix passes {separate:7.2f}   padded decode over joined tables {plain:7.2f}"
              f"   (torch shared / C++ shared {shared / cpp_shared:4.2f}x)")


SMOLLM2_LINEARS = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # a layer's qkv, o, gate_up, down
SMOLLM2_GATE_UP = SMOLLM2_LINEARS[2]


def onednn_prepacked(weights: list[torch.Tensor]) -> list[torch.Tensor] | None:
    """bf16 weights prepacked for oneDNN's linear, what torch's bf16 path runs best without the kernel; None for
    fp32, whose baseline is F.linear (MKL)."""
    if weights[0].dtype != torch.bfloat16:
        return None
    try:
        return [torch.ops.mkldnn._reorder_linear_weight(w, 1) for w in weights]
    except RuntimeError:  # oneDNN prepacks bf16 only on CPUs with AVX-512 (or AVX-NE-CONVERT): F.linear then
        return None


def onednn_linear(x: torch.Tensor, prepacked: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, prepacked, None, "none", [], "")


def kernel_linear_dtypes(cpp) -> list[torch.dtype]:
    """The dtypes the linear kernel takes on this CPU (bf16 needs AVX-512 BF16)."""
    return [d for d in (torch.float32, torch.bfloat16) if cpp.supports_linear(torch.empty(32, 32, dtype=d))]


def bench_cpu_linears() -> None:
    """SmolLM2's 120 decoder linears (30 layers) at decode (1-64 rows) and prefill (96-1,000 rows): the
    C++ kernel against what torch runs without it (bf16: oneDNN on prepacked weights; fp32: F.linear),
    alternating per round, with the weights' read rate and the multiply-adds' rate."""
    cpp = native.library()
    print(f"CPU linears, SmolLM2's 30 layers ({torch.get_num_threads()} threads), median ms, weight GB/s, GFLOP/s")
    for dtype in kernel_linear_dtypes(cpp):
        weights = [torch.randn(shape, dtype=dtype) for _ in range(30) for shape in SMOLLM2_LINEARS]
        native_packed = [native.pack_linear(w) for w in weights]
        onednn_packed = onednn_prepacked(weights)
        gigabytes = sum(w.numel() * w.element_size() for w in weights) / 1e9
        for rows in (1, 4, 8, 16, 32, 64, 96, 128, 256, 1000):
            inputs = {size: torch.randn(rows, size, dtype=dtype) for size in (576, 1536)}

            def kernel():
                return [cpp.linear(inputs[w.shape[1]], p, None) for w, p in zip(weights, native_packed)]

            def baseline():
                if onednn_packed:
                    return [onednn_linear(inputs[w.shape[1]], p) for w, p in zip(weights, onednn_packed)]
                return [F.linear(inputs[w.shape[1]], w) for w in weights]

            ours, theirs = alternating_cpu_ms(kernel, baseline, rounds=9 if rows <= 64 else 3)
            gigaflops = 2 * rows * gigabytes / weights[0].element_size()
            print(f"  linear {str(dtype):<15} {rows:>4} rows: C++ {ours:8.2f} ({gigabytes / ours * 1e3:5.1f} GB/s, "
                  f"{gigaflops / ours * 1e3:4.0f} GFLOP/s)   torch {theirs:8.2f} ({gigabytes / theirs * 1e3:5.1f} GB/s, "
                  f"{gigaflops / theirs * 1e3:4.0f} GFLOP/s)   (torch / C++ {theirs / ours:4.2f}x)")


def bench_cpu_gated_linears() -> None:
    """The MLP's first half, silu(x @ gate.T) * (x @ up.T), over SmolLM2's 30 [3,072 x 576] gate-and-up weights:
    the kernel's gated call (which writes only the product) against torch's linear, then silu and a multiply
    (bf16: oneDNN on prepacked weights; fp32: F.linear, MKL), alternating per round. fp32 keeps the kernel at
    every row count on these figures (kernels/native_linear.py)."""
    cpp = native.library()
    print(f"CPU gated linears, SmolLM2's 30 layers ({torch.get_num_threads()} threads), median ms")
    for dtype in kernel_linear_dtypes(cpp):
        weights = [torch.randn(SMOLLM2_GATE_UP, dtype=dtype) for _ in range(30)]
        packed = [native.pack_gated_linear(w) for w in weights]
        onednn_packed = onednn_prepacked(weights)
        for rows in (1, 16, 64, 96, 256, 1000):
            x = torch.randn(rows, SMOLLM2_GATE_UP[1], dtype=dtype)

            def kernel():
                return [cpp.gated_linear(x, p) for p in packed]

            def baseline():
                # layer by layer, as an engine runs them: each layer's silu and multiply right after its linear
                both = ((onednn_linear(x, p) for p in onednn_packed)
                        if onednn_packed else (F.linear(x, w) for w in weights))
                return [F.silu(gate) * up for gate, up in (b.chunk(2, dim=-1) for b in both)]

            ours, theirs = alternating_cpu_ms(kernel, baseline, rounds=9 if rows <= 64 else 5)
            print(f"  gated {str(dtype):<15} {rows:>4} rows: C++ {ours:8.2f}   torch linear, silu, multiply {theirs:8.2f}"
                  f"   (torch / C++ {theirs / ours:4.2f}x)")


def bench_cpu_argmax() -> None:
    """A greedy step's argmax over SmolLM2's vocabulary at 1, 16 and 64 sequences: the C++ row argmax the
    sampler takes against torch's argmax, and torch's amax (the max alone, no index: what one pass can cost)."""
    cpp = native.library()
    print(f"greedy argmax over 49,152 fp32 logits ({torch.get_num_threads()} threads), median ms")
    for rows in (1, 16, 64):
        logits = torch.randn(rows, 49152)
        ours, theirs = alternating_cpu_ms(lambda: cpp.argmax_rows(logits), lambda: logits.argmax(dim=-1).tolist(), rounds=51)
        _, amax = alternating_cpu_ms(lambda: cpp.argmax_rows(logits), lambda: logits.amax(dim=-1), rounds=51)
        print(f"  argmax {rows:>3} rows: C++ {ours:6.3f}   torch argmax {theirs:6.3f} ({theirs / ours:4.1f}x)   "
              f"torch amax {amax:6.3f}")


def alternating_cpu_ms(first, second, rounds: int) -> tuple[float, float]:
    """Median ms of each function, run in turn each round (this box's speed drifts by ~10%)."""
    first(), second()
    times = ([], [])
    for _ in range(rounds):
        for fn, spent in zip((first, second), times):
            start = time.perf_counter()
            fn()
            spent.append(time.perf_counter() - start)
    return statistics.median(times[0]) * 1e3, statistics.median(times[1]) * 1e3


CPU_PARTS = {"attention": bench_cpu, "linears": bench_cpu_linears, "gated": bench_cpu_gated_linears,
             "argmax": bench_cpu_argmax}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--peak-tbps", type=float, help="HBM peak in TB/s (default: from the device name)")
    parser.add_argument("--cpu", action="store_true", help="benchmark the CPU dispatch paths")
    parser.add_argument("--only", nargs="+", choices=sorted(CPU_PARTS), default=list(CPU_PARTS),
                        help="with --cpu: which comparisons to run (default: all)")
    parser.add_argument("--threads", type=int, help="torch CPU threads (1 gives steadier figures on a shared machine)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu or not torch.cuda.is_available():
        if not torch.cuda.is_available():
            print("the Triton kernel benchmarks need CUDA; running the CPU dispatch comparison instead\n")
        for part in args.only:
            CPU_PARTS[part]()
        return
    peak = peak_tbps(args.peak_tbps)
    print(f"{torch.cuda.get_device_name()}, HBM peak {peak} TB/s\n")
    for bench in (bench_decode, bench_shared_prefix, bench_prefill, bench_kv_write):
        bench(peak)
        print()


if __name__ == "__main__":
    main()
