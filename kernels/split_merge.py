"""Merge split-K attention partials by log-sum-exp (the second stage of flash-decoding).

Each split s of a (sequence, head) holds its softmax-normalised output o_s and lse_s, the base-2
log-sum-exp of its scaled scores. The exact attention over all splits is
    sum_s 2^(lse_s - m) * o_s / sum_s 2^(lse_s - m),   m = max_s lse_s.
An empty split carries lse = -inf and its output is not read; a row whose splits are all empty
(a padded batch slot with no context) comes out as zeros, not NaN.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.validation import FLOAT_DTYPES, expect, expect_same_device, expect_triton_device


@triton.jit
def _merge_splits_kernel(
    partial_out_ptr, partial_lse_ptr, out_ptr,
    stride_pb, stride_ph, stride_ps,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    split_mask = splits < num_splits

    lse = tl.load(partial_lse_ptr + b * stride_lb + h * stride_lh + splits, mask=split_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp2(lse - top)  # [BLOCK_S], 0 for empty splits
    total = tl.sum(weights, axis=0)

    # an empty split's output is never read: it may be uninitialised memory, and 0 * NaN is NaN
    live = split_mask & (lse > float("-inf"))
    partial = tl.load(
        partial_out_ptr + b * stride_pb + h * stride_ph + splits[:, None] * stride_ps + dims[None, :],
        mask=live[:, None] & (dims[None, :] < HEAD_DIM),
        other=0.0,
    )  # [BLOCK_S, BLOCK_D]
    merged = tl.sum(weights[:, None] * partial, axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dims, merged.to(out_ptr.dtype.element_ty), mask=dims < HEAD_DIM)


def merge_splits(partial_out: torch.Tensor, partial_lse: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """partial_out [B, H, S, D] fp32 and partial_lse [B, H, S] fp32 (base 2) -> out [B, H, D]."""
    expect(partial_out, "partial_out", ndim=4, dtypes=(torch.float32,))
    batch, num_heads, num_splits, head_dim = partial_out.shape
    expect(partial_lse, "partial_lse", ndim=3, dtypes=(torch.float32,), shape={0: batch, 1: num_heads, 2: num_splits})
    expect(out, "out", ndim=3, dtypes=FLOAT_DTYPES, shape={0: batch, 1: num_heads, 2: head_dim})
    expect_same_device(partial_out=partial_out, partial_lse=partial_lse, out=out)
    expect_triton_device(out)
    if batch == 0:
        return out
    _merge_splits_kernel[(batch, num_heads)](
        partial_out, partial_lse, out,
        partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
        partial_lse.stride(0), partial_lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_S=max(triton.next_power_of_2(num_splits), 2),
    )
    return out
