"""Paged decode attention: one new query token per sequence over its paged KV cache.

Flash-decoding layout: program (sequence b, kv head, split s) reads tokens
[s * tokens_per_split, (s + 1) * tokens_per_split) of sequence b once and serves all query heads
of that kv head's GQA group with it (the group is padded to 16 rows so tl.dot can use tensor
cores). With one split the program writes the final output; with several each writes a
normalised partial plus its log-sum-exp and `split_merge` combines them. The split count only
depends on static sizes (batch, heads, block table width), so the launch never reads a tensor
back to the host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.split_merge import merge_splits
from kernels.triton_helpers import LOG2E, attend_pages, device_sms, use_fp32_dot
from kernels.validation import check_decode_args, expect, expect_triton_device

BLOCK_N = 32  # tokens per tile, each token's page looked up on its own; 64 spills at head_dim 128
MIN_TOKENS_PER_SPLIT = 128  # below this a split's fixed cost outweighs the parallelism it adds
MAX_SPLITS = 64


@triton.jit
def _decode_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr, out_ptr, lse_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    scale, tokens_per_split, split_offset, window,
    GROUP: tl.constexpr, BLOCK_H: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, DIRECT: tl.constexpr,
):
    b = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    context_len = tl.load(context_lens_ptr + b)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, context_len)
    if window > 0:  # a sliding window: the query (the last token) sees only the last `window` keys
        start = tl.maximum(start, context_len - window)

    rows = tl.arange(0, BLOCK_H)
    heads = kv_head * GROUP + rows
    head_mask = rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=head_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_H, BLOCK_D]
    qk_scale = scale * LOG2E  # fold log2(e) into the scale so the softmax can use exp2

    row_max, row_sum, acc = attend_pages(
        q, block_tables_ptr + b * stride_bt, start, end, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_mask,
        stride_kb, stride_kt, stride_kh, qk_scale, BLOCK_H, BLOCK_D, PAGE, BLOCK_N, FP32_DOT,
    )

    out = acc / tl.where(row_sum > 0, row_sum, 1.0)[:, None]
    out_offsets = b * stride_ob + heads[:, None] * stride_oh + (split_offset + split) * stride_os + dims[None, :]
    tl.store(out_ptr + out_offsets, out.to(out_ptr.dtype.element_ty), mask=head_mask[:, None] & dim_mask[None, :])
    if not DIRECT:
        lse = tl.where(row_sum > 0, row_max + tl.log2(tl.where(row_sum > 0, row_sum, 1.0)), float("-inf"))
        tl.store(lse_ptr + b * stride_lb + heads * stride_lh + split_offset + split, lse, mask=head_mask)


def num_warps(head_dim: int) -> int:
    """4 warps hold a head_dim-64 tile in registers; head_dim 128 needs 8 (python -m kernels.compile_check)."""
    return 4 if head_dim <= 64 else 8


def choose_num_splits(
    batch: int, num_kv_heads: int, max_context_len: int, num_sms: int, min_tokens: int = MIN_TOKENS_PER_SPLIT
) -> int:
    """Enough (sequence, kv head, split) programs to fill the GPU twice, without tiny splits."""
    wanted = triton.cdiv(2 * num_sms, max(batch * num_kv_heads, 1))
    longest = triton.cdiv(max(max_context_len, 1), min_tokens)
    return max(1, min(wanted, longest, MAX_SPLITS))


def tokens_per_split(max_context_len: int, num_splits: int) -> int:
    return triton.cdiv(triton.cdiv(max(max_context_len, 1), num_splits), BLOCK_N) * BLOCK_N


def launch_decode_splits(
    q, k_cache, v_cache, block_tables, context_lens, scale, out, lse, *, num_splits: int, split_offset: int = 0,
    window: int | None = None,
) -> None:
    """Stage 1 only: write splits [split_offset, split_offset + num_splits) of out [B, H, S, D]
    and lse [B, H, S]; with lse None, num_splits must be 1 and out is the final [B, H, D]. A split wholly
    before a row's ``window`` reads nothing (its lse -inf)."""
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    direct = lse is None
    if direct and num_splits != 1:
        raise ValueError("writing the final output directly needs num_splits == 1")
    max_context_len = block_tables.shape[1] * block_size
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, out if direct else lse,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1), 0 if direct else out.stride(2),
        0 if direct else lse.stride(0), 0 if direct else lse.stride(1),
        scale, tokens_per_split(max_context_len, num_splits), split_offset, window or 0,
        GROUP=group, BLOCK_H=max(16, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=block_size, BLOCK_N=BLOCK_N, FP32_DOT=use_fp32_dot(q.dtype), DIRECT=direct,
        num_warps=num_warps(head_dim),
    )


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_splits: int | None = None,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Attention of q [B, H, D] over each sequence's first context_lens[b] cached tokens -> [B, H, D]; with a
    sliding ``window``, over only the last ``window`` of them (the blocks before it are not read, and may be freed).

    block_tables [B, max_blocks] int32 lists each sequence's cache blocks; entries past the
    sequence's length are never read. k_cache/v_cache [num_blocks, block_size, KVH, D] with
    H % KVH == 0. context_lens[b] == 0 gives a zero row. num_splits overrides the split-K choice.
    """
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens)
    expect_triton_device(q)
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    expect(out, "out", ndim=3, dtypes=(q.dtype,), shape=dict(enumerate(q.shape)))
    if batch == 0:
        return out
    if num_splits is None:
        max_context_len = block_tables.shape[1] * k_cache.shape[1]
        num_splits = choose_num_splits(batch, k_cache.shape[2], max_context_len, device_sms(q))
    if num_splits == 1:
        launch_decode_splits(q, k_cache, v_cache, block_tables, context_lens, scale, out, None, num_splits=1,
                             window=window)
        return out
    partial_out = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    launch_decode_splits(
        q, k_cache, v_cache, block_tables, context_lens, scale, partial_out, partial_lse, num_splits=num_splits,
        window=window,
    )
    return merge_splits(partial_out, partial_lse, out)
