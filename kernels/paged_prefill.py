"""Paged prefill / extend attention: causal attention of a batch of new tokens over their
sequences' cached prefix plus themselves.

Varlen: the new tokens of all sequences are packed along one axis (cu_seqlens_q), and their
keys/values are already in the paged cache (kv_write runs first), so a chunked prefill, a
prefix-cache hit and a fresh prompt are the same case: sequence b's last
q_len = cu_seqlens_q[b+1] - cu_seqlens_q[b] cached tokens are its queries, and query i sits at
position context_lens[b] - q_len + i. Program (query tile, sequence, head) streams the keys up to
its tile's last position, so tiles above the causal diagonal are never read.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.triton_helpers import LOG2E, attend_pages, use_fp32_dot
from kernels.validation import check_prefill_args, expect, expect_triton_device

BLOCK_M = 64  # query tokens per program
BLOCK_N = 64  # key tokens per tile
NUM_WARPS = 8  # 4 spill registers at head_dim 128 (python -m kernels.compile_check)


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, cu_seqlens_q_ptr, context_lens_ptr, out_ptr,
    stride_qt, stride_qh,
    stride_kb, stride_kt, stride_kh,
    stride_bt,
    stride_ot, stride_oh,
    scale, window,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP32_DOT: tl.constexpr, WINDOWED: tl.constexpr,
):
    tile = tl.program_id(0)
    b = tl.program_id(1)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(cu_seqlens_q_ptr + b)
    q_len = tl.load(cu_seqlens_q_ptr + b + 1) - q_start
    if tile * BLOCK_M >= q_len:
        return  # the grid is sized for the longest sequence
    context_len = tl.load(context_lens_ptr + b)
    prefix_len = context_len - q_len

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_mask = rows < q_len
    positions = prefix_len + rows  # [BLOCK_M] absolute position of each query
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    q = tl.load(
        q_ptr + (q_start + rows)[:, None] * stride_qt + head * stride_qh + dims[None, :],
        mask=row_mask[:, None] & dim_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, BLOCK_D]
    qk_scale = scale * LOG2E

    end = tl.minimum(context_len, prefix_len + (tile + 1) * BLOCK_M)  # causal: nothing past the tile's last query
    start = 0
    if WINDOWED:  # nothing before the tile's first query's window (each row masks its own)
        start = tl.maximum(prefix_len + tile * BLOCK_M - window + 1, 0)
    # every query sees itself, so every row sees a key and row_sum > 0
    row_max, row_sum, acc = attend_pages(
        q, block_tables_ptr + b * stride_bt, start, end, k_cache_ptr, v_cache_ptr, kv_head, dims, dim_mask,
        stride_kb, stride_kt, stride_kh, qk_scale, BLOCK_M, BLOCK_D, PAGE, BLOCK_N, FP32_DOT,
        positions=positions, CAUSAL=True, window=window, WINDOWED=WINDOWED,
    )

    out = acc / row_sum[:, None]
    tl.store(
        out_ptr + (q_start + rows)[:, None] * stride_ot + head * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_mask[:, None] & dim_mask[None, :],
    )


def paged_prefill(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    *,
    out: torch.Tensor | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens q [T, H, D] over cache + themselves -> [T, H, D]; with a sliding
    ``window``, each query over only the last ``window`` tokens up to itself.

    cu_seqlens_q [B+1] int32 (cumulative new-token counts, cu_seqlens_q[-1] == T);
    context_lens [B] int32, each sequence's cached length including its new tokens (>= its q_len);
    block_tables [B, max_blocks] int32; max_seqlen_q a host int >= every q_len (sizes the grid).
    """
    group = check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    expect_triton_device(q)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty_like(q) if out is None else out
    expect(out, "out", ndim=3, dtypes=(q.dtype,), shape=dict(enumerate(q.shape)))
    batch = context_lens.shape[0]
    if num_tokens == 0 or batch == 0 or max_seqlen_q <= 0:
        return out
    grid = (triton.cdiv(max_seqlen_q, BLOCK_M), batch, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, out,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        scale, window or 0,
        GROUP=group, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim), PAGE=k_cache.shape[1],
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, FP32_DOT=use_fp32_dot(q.dtype), WINDOWED=bool(window),
        num_warps=NUM_WARPS,
    )
    return out
