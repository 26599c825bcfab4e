"""Shared-prefix decode attention: each shared prefix's KV is read once for all its sequences.

A batch holds several shared prefixes (e.g. one system prompt forked into many branches); each
sequence b names its prefix prefix_ids[b] (-1: none) and owns a private suffix. Attention splits
exactly into prefix and suffix parts merged by log-sum-exp:

  1. prefix pass: program (row tile, kv head x split, prefix p) gathers the queries of every
     sequence sharing p (GQA group rows of all of them stacked as one matrix, so tl.dot runs at
     full tile size) and streams one split of p's KV once for all of them;
  2. suffix pass: the paged decode split kernel over each sequence's own blocks;
  3. merge: both passes write normalised partials + lse into one [B, H, S, D] buffer and
     `split_merge` combines them.

Sequences are grouped by prefix on the device (argsort + searchsorted), so nothing is read back
to the host and the grid depends only on static sizes.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.paged_decode import choose_num_splits, launch_decode_splits, tokens_per_split
from kernels.split_merge import merge_splits
from kernels.triton_helpers import LOG2E, attend_pages, device_sms, use_fp32_dot
from kernels.validation import check_shared_prefix_args, expect, expect_triton_device

BLOCK_M = 64  # (sequence, head) query rows per program
NUM_WARPS = 8  # 4 spill registers at head_dim 128 (python -m kernels.compile_check)
# A prefix split writes an fp32 partial for every row it serves; with 64 sequences those writes
# outweigh a 128-token split's KV reads, so prefix splits are kept longer than decode's.
MIN_PREFIX_TOKENS_PER_SPLIT = 256


def tile_tokens(head_dim: int) -> int:
    """Prefix tokens per tile: 64 fits in registers beside 64 query rows up to head_dim 64."""
    return 64 if head_dim <= 64 else 32


@triton.jit
def _prefix_split_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, prefix_block_tables_ptr, prefix_lens_ptr, seq_order_ptr, prefix_starts_ptr,
    out_ptr, lse_ptr,
    stride_qb, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    stride_ob, stride_oh, stride_os,
    stride_lb, stride_lh,
    scale, tokens_per_split, num_splits,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr,
):
    row_tile = tl.program_id(0)
    kv_head = tl.program_id(1) // num_splits
    split = tl.program_id(1) % num_splits
    prefix = tl.program_id(2)

    first_seq = tl.load(prefix_starts_ptr + prefix)
    num_rows = (tl.load(prefix_starts_ptr + prefix + 1) - first_seq) * GROUP
    if row_tile * BLOCK_M >= num_rows:
        return  # the grid is sized as if one prefix held the whole batch
    prefix_len = tl.load(prefix_lens_ptr + prefix)
    start = split * tokens_per_split
    end = tl.minimum(start + tokens_per_split, prefix_len)

    rows = row_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < num_rows
    seqs = tl.load(seq_order_ptr + first_seq + rows // GROUP, mask=row_mask, other=0).to(tl.int64)  # [BLOCK_M]
    heads = kv_head * GROUP + rows % GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + seqs[:, None] * stride_qb + heads[:, None] * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    qk_scale = scale * LOG2E

    row_max, row_sum, acc = attend_pages(
        q, prefix_block_tables_ptr + prefix * stride_bt, start, end, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_mask,
        stride_kb, stride_kt, stride_kh, qk_scale, BLOCK_M, BLOCK_D, PAGE, BLOCK_N, FP32_DOT,
    )

    has_keys = row_sum > 0
    out = acc / tl.where(has_keys, row_sum, 1.0)[:, None]
    lse = tl.where(has_keys, row_max + tl.log2(tl.where(has_keys, row_sum, 1.0)), float("-inf"))
    tl.store(
        out_ptr + seqs[:, None] * stride_ob + heads[:, None] * stride_oh + split * stride_os + dims[None, :],
        out,
        mask=row_mask[:, None] & dim_mask[None, :],
    )
    tl.store(lse_ptr + seqs * stride_lb + heads * stride_lh + split, lse, mask=row_mask)


def group_by_prefix(prefix_ids: torch.Tensor, num_prefixes: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequence indices sorted by prefix, and where each prefix's run starts ([P + 1], cumulative).

    Sequences without a prefix (-1) sort first, before prefix_starts[0], and so join no group.
    """
    sorted_ids, seq_order = torch.sort(prefix_ids.long(), stable=True)
    wanted = torch.arange(num_prefixes + 1, device=prefix_ids.device)
    prefix_starts = torch.searchsorted(sorted_ids, wanted)
    return seq_order.to(torch.int32), prefix_starts.to(torch.int32)


def shared_prefix_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_ids: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    suffix_block_tables: torch.Tensor,
    suffix_lens: torch.Tensor,
    scale: float,
    *,
    prefix_splits: int | None = None,
    suffix_splits: int | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode attention of q [B, H, D] over (shared prefix ++ own suffix) of each sequence -> [B, H, D].

    prefix_ids [B] int32 in [-1, P); prefix_block_tables [P, max_prefix_blocks] int32 and
    prefix_lens [P] int32 describe the P shared prefixes; suffix_block_tables [B, max_blocks] and
    suffix_lens [B] each sequence's own tokens, which logically follow its prefix (suffix token 0
    is at offset 0 of its first suffix block). A prefix of length 0 and a suffix of length 0 are
    both fine. prefix_splits / suffix_splits override the split-K choices.
    """
    num_prefixes = check_shared_prefix_args(
        q, k_cache, v_cache, prefix_ids, prefix_block_tables, prefix_lens, suffix_block_tables, suffix_lens
    )
    expect_triton_device(q)
    batch, num_heads, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    expect(out, "out", ndim=3, dtypes=(q.dtype,), shape=dict(enumerate(q.shape)))
    if batch == 0:
        return out
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    row_tiles = triton.cdiv(batch * group, BLOCK_M)
    max_prefix_len = prefix_block_tables.shape[1] * block_size
    sms = device_sms(q)
    if prefix_splits is None:
        busy_tiles = num_prefixes * max(1, row_tiles // max(num_prefixes, 1))
        prefix_splits = choose_num_splits(busy_tiles, num_kv_heads, max_prefix_len, sms, MIN_PREFIX_TOKENS_PER_SPLIT)
    if suffix_splits is None:
        suffix_splits = choose_num_splits(batch, num_kv_heads, suffix_block_tables.shape[1] * block_size, sms)

    total_splits = prefix_splits + suffix_splits
    partial_out = torch.empty(batch, num_heads, total_splits, head_dim, dtype=torch.float32, device=q.device)
    partial_lse = torch.empty(batch, num_heads, total_splits, dtype=torch.float32, device=q.device)
    partial_lse[:, :, :prefix_splits] = float("-inf")  # rows of prefix-less sequences stay empty

    if num_prefixes:
        seq_order, prefix_starts = group_by_prefix(prefix_ids, num_prefixes)
        _prefix_split_kernel[(row_tiles, num_kv_heads * prefix_splits, num_prefixes)](
            q, k_cache, v_cache, prefix_block_tables, prefix_lens, seq_order, prefix_starts,
            partial_out, partial_lse,
            q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            prefix_block_tables.stride(0),
            partial_out.stride(0), partial_out.stride(1), partial_out.stride(2),
            partial_lse.stride(0), partial_lse.stride(1),
            scale, tokens_per_split(max_prefix_len, prefix_splits), prefix_splits,
            GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGE=block_size,
            BLOCK_M=BLOCK_M, BLOCK_N=tile_tokens(head_dim), FP32_DOT=use_fp32_dot(q.dtype), num_warps=NUM_WARPS,
        )
    launch_decode_splits(
        q, k_cache, v_cache, suffix_block_tables, suffix_lens, scale, partial_out, partial_lse,
        num_splits=suffix_splits, split_offset=prefix_splits,
    )
    return merge_splits(partial_out, partial_lse, out)
