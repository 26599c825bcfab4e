"""Small Triton pieces shared by the attention kernels."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.validation import interpreting

LOG2E = tl.constexpr(1.4426950408889634)  # kernels run softmax in base 2: exp2 is one instruction, exp is two


@triton.jit
def mma(a, b, FP32_DOT: tl.constexpr):
    """a @ b with fp32 accumulation.

    FP32_DOT upcasts both operands and asks for IEEE fp32: the Triton interpreter (3.x) returns
    garbage from a bf16 tl.dot, and fp32 caches should not silently drop to tf32 on GPU.
    """
    if FP32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


@triton.jit
def attend_pages(q, table, start, end, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_mask,
                 stride_kb, stride_kt, stride_kh, qk_scale,
                 ROWS: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr, BLOCK_N: tl.constexpr,
                 FP32_DOT: tl.constexpr, positions=None, CAUSAL: tl.constexpr = False, window=0,
                 WINDOWED: tl.constexpr = False):
    """Online softmax of q [ROWS, BLOCK_D] over the paged keys [start, end) of one block table and kv head.
    With CAUSAL, row r sees only keys at or before positions[r] (prefill); WINDOWED too, only keys after
    positions[r] - window (a sliding window: each row's own first key, where ``start`` is the first row's).

    Returns (row_max, row_sum, acc): base-2 running max, sum of exp2, and the unnormalised output."""
    row_max = tl.full([ROWS], float("-inf"), tl.float32)
    row_sum = tl.zeros([ROWS], tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], tl.float32)
    for tile_start in range(start, end, BLOCK_N):
        tokens = tile_start + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        blocks = tl.load(table + tokens // PAGE, mask=token_mask, other=0).to(tl.int64)
        offsets = blocks * stride_kb + (tokens % PAGE) * stride_kt + kv_head * stride_kh  # [BLOCK_N]
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)  # [BLOCK_N, BLOCK_D]
        v = tl.load(v_cache_ptr + offsets[:, None] + dims[None, :], mask=kv_mask, other=0.0)

        scores = mma(q, tl.trans(k), FP32_DOT) * qk_scale  # [ROWS, BLOCK_N]
        visible = token_mask[None, :]
        if CAUSAL:
            visible = visible & (tokens[None, :] <= positions[:, None])
        if WINDOWED:
            visible = visible & (tokens[None, :] > positions[:, None] - window)
        scores = tl.where(visible, scores, float("-inf"))
        new_max = tl.maximum(row_max, tl.max(scores, axis=1))
        probs = tl.exp2(scores - new_max[:, None])
        rescale = tl.exp2(row_max - new_max)
        row_sum = row_sum * rescale + tl.sum(probs, axis=1)
        acc = acc * rescale[:, None] + mma(probs.to(v.dtype), v, FP32_DOT)
        row_max = new_max
    return row_max, row_sum, acc


def use_fp32_dot(dtype: torch.dtype) -> bool:
    return interpreting() or dtype == torch.float32


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    """SM count used to size split-K grids."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(tensor: torch.Tensor) -> int:
    if not tensor.is_cuda:
        return 132  # interpreter runs size their grids as an H100 would
    return multiprocessor_count(tensor.device.index or 0)
