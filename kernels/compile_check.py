"""Compile every Triton kernel for a CUDA target on a machine without a GPU.

The interpreter tests check what the kernels compute but not that they compile: tl.dot shape
limits, layouts and register pressure only show up in the real compiler. Triton compiles ahead
of time for any target (it ships ptxas), so this runs on CPU and reports each kernel's
registers per thread and stack bytes (non-zero stack means register spills) for review.

    python -m kernels.compile_check        # sm_90 (H100/H200) and sm_80 (A100)
    python -m kernels.compile_check 90     # one target

Must run without TRITON_INTERPRET (an interpreted kernel cannot be compiled).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from kernels import kv_write, paged_decode, paged_prefill, shared_prefix_decode, split_merge

HEAD_SHAPES = {"bf16": dict(GROUP=4, HEAD_DIM=128, BLOCK_D=128), "fp32": dict(GROUP=3, HEAD_DIM=64, BLOCK_D=64)}
ATTENTION_PTRS = ("q_ptr", "k_cache_ptr", "v_cache_ptr")
TABLE_PTRS = ("block_tables_ptr", "context_lens_ptr", "cu_seqlens_q_ptr", "prefix_block_tables_ptr",
              "prefix_lens_ptr", "seq_order_ptr", "prefix_starts_ptr", "slot_mapping_ptr")


def variants() -> list[tuple[str, object, dict[str, str], dict, int]]:
    """(label, kernel, pointer dtypes, constexprs, num_warps) as the launchers configure them:
    bf16 with head_dim 128 (the register-heavy case), fp32 with SmolLM2's head_dim 64."""
    found = []
    for dtype, heads in HEAD_SHAPES.items():
        fp32_dot, head_dim = dtype == "fp32", heads["HEAD_DIM"]
        attn = {name: dtype for name in ATTENTION_PTRS}
        for direct in (True, False):
            out = dtype if direct else "fp32"
            found.append((
                f"decode {dtype} direct={direct}", paged_decode._decode_split_kernel, {**attn, "out_ptr": out, "lse_ptr": out},
                dict(heads, BLOCK_H=16, PAGE=16, BLOCK_N=paged_decode.BLOCK_N, FP32_DOT=fp32_dot, DIRECT=direct),
                paged_decode.num_warps(head_dim),
            ))
        for windowed in (False, True):
            found.append((
                f"prefill {dtype}" + (" windowed" if windowed else ""), paged_prefill._prefill_kernel,
                {**attn, "out_ptr": dtype},
                dict(heads, PAGE=16, BLOCK_M=paged_prefill.BLOCK_M, BLOCK_N=paged_prefill.BLOCK_N, FP32_DOT=fp32_dot,
                     WINDOWED=windowed),
                paged_prefill.NUM_WARPS,
            ))
        found.append((
            f"shared prefix {dtype}", shared_prefix_decode._prefix_split_kernel, {**attn, "out_ptr": "fp32", "lse_ptr": "fp32"},
            dict(heads, PAGE=16, BLOCK_M=shared_prefix_decode.BLOCK_M, BLOCK_N=shared_prefix_decode.tile_tokens(head_dim),
                 FP32_DOT=fp32_dot),
            shared_prefix_decode.NUM_WARPS,
        ))
        found.append((
            f"merge splits -> {dtype}", split_merge._merge_splits_kernel,
            {"partial_out_ptr": "fp32", "partial_lse_ptr": "fp32", "out_ptr": dtype},
            dict(HEAD_DIM=head_dim, BLOCK_D=heads["BLOCK_D"], BLOCK_S=32), 4,
        ))
        found.append((
            f"kv_write {dtype}", kv_write._kv_write_kernel,
            {"key_ptr": dtype, "value_ptr": dtype, "k_cache_ptr": dtype, "v_cache_ptr": dtype},
            dict(NUM_KV_HEADS=8, HEAD_DIM=head_dim, BLOCK_KVH=8, BLOCK_D=heads["BLOCK_D"], PAGE=16), 4,
        ))
    return found


def signature(kernel, pointers: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Argument types by name: listed pointers, i32 index tables, constexprs, fp32 scale, i32 rest."""
    types = {}
    for name in kernel.arg_names:
        if name in constexprs:
            types[name] = "constexpr"
        elif name in pointers:
            types[name] = "*" + pointers[name]
        elif name in TABLE_PTRS:
            types[name] = "*i32"
        elif name == "scale":
            types[name] = "fp32"
        else:
            types[name] = "i32"
    return types


def resource_usage(cubin: bytes) -> dict[str, int]:
    """REG and STACK of the cubin's kernel, read with the cuobjdump Triton ships."""
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as file:
        file.write(cubin)
        file.flush()
        dump = subprocess.run([tool, "--dump-resource-usage", file.name], capture_output=True, text=True, check=True).stdout
    return {key: int(value) for key, value in re.findall(r"(REG|STACK):(\d+)", dump)}


def compile_all(capabilities=(90, 80)) -> list[dict]:
    """Compile every variant for every capability (raises on a compile error); one record each."""
    records = []
    for capability in capabilities:
        target = GPUTarget("cuda", capability, 32)
        for label, kernel, pointers, constexprs, warps in variants():
            source = ASTSource(kernel, signature(kernel, pointers, constexprs), constexprs)
            compiled = triton.compile(source, target=target, options={"num_warps": warps})
            usage = resource_usage(compiled.asm["cubin"])
            records.append(dict(target=f"sm_{capability}", label=label, warps=warps, shared=compiled.metadata.shared,
                                regs=usage.get("REG"), stack=usage.get("STACK")))
    return records


if __name__ == "__main__":
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for record in compile_all(tuple(int(c) for c in sys.argv[1:]) or (90, 80)):
        print("{target} {label:<26} warps={warps} regs={regs:>3} stack={stack:>3} B shared={shared:>6} B".format(**record))
