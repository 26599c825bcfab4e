"""Write new tokens' keys and values into the paged KV cache by slot.

slot = block_id * block_size + offset; slot -1 marks a padding token (a CUDA-graph batch padded
to a fixed size), which is skipped, so the caller never has to compact its batch.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.validation import check_kv_write_args, expect_triton_device


@triton.jit
def _kv_write_kernel(
    key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_cb, stride_ct, stride_ch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_KVH: tl.constexpr, BLOCK_D: tl.constexpr, PAGE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token).to(tl.int64)
    if slot < 0:
        return
    heads = tl.arange(0, BLOCK_KVH)
    dims = tl.arange(0, BLOCK_D)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)  # [BLOCK_KVH, BLOCK_D]

    key = tl.load(key_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
    value = tl.load(value_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
    cache_offsets = (slot // PAGE) * stride_cb + (slot % PAGE) * stride_ct + heads[:, None] * stride_ch + dims[None, :]
    tl.store(k_cache_ptr + cache_offsets, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offsets, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def kv_write(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """In place: key/value [T, KVH, D] of token i go to slot slot_mapping[i] of k_cache/v_cache
    [num_blocks, block_size, KVH, D] (cast to the cache dtype); slot -1 is skipped."""
    check_kv_write_args(key, value, k_cache, v_cache, slot_mapping)
    expect_triton_device(key)
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _kv_write_kernel[(num_tokens,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_KVH=triton.next_power_of_2(num_kv_heads), BLOCK_D=triton.next_power_of_2(head_dim),
        PAGE=k_cache.shape[1],
    )
