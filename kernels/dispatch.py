"""The attention and cache-write entry points the engine calls; they pick the implementation.

CUDA tensors go to the Triton kernels in this package (decode goes to flash-attn's paged kernel
instead when flash-attn is installed and the cache's block size is one it supports, a multiple
of 256); CPU tensors go to the C++ kernels in native/ where they build here (kernels/native.py:
decode, shared-prefix decode, prefill in tiles, KV writes), otherwise to the torch paths in cpu_attention. Every function takes the same
arguments on both, so the engine has one call site per operation. PARROT_ATTENTION_BACKEND=triton
sends every tensor to this package's Triton kernels (CPU ones then need TRITON_INTERPRET=1): the
engine's tests run the kernels that way.

Shared conventions:
  * q is [tokens or sequences, num_heads, head_dim]; the caches are per-layer k_cache/v_cache
    [num_blocks, block_size, num_kv_heads, head_dim] with num_heads % num_kv_heads == 0, and q
    has the cache's dtype.
  * Block tables are int32 [rows, max_blocks]; token t of a row lives in block
    table[t // block_size] at offset t % block_size. Entries past a row's length are not read,
    so tables may be padded with any value.
  * Lengths are int32 device tensors. On CUDA nothing is read back to the host (the launches
    are CUDA-graph safe); host ints (max_seqlen_q) are passed explicitly.
  * scale multiplies q.k before the softmax (usually head_dim ** -0.5).
  * plan (optional, CPU only): what the torch path reads of a step's lengths and tables, made once
    per step by cpu_attention.plan_* and shared by every layer's call; Triton ignores it.
"""

from __future__ import annotations

import importlib.util
import os

import torch

from kernels import cpu_attention, native
from kernels.validation import check_decode_args, check_kv_write_args, check_prefill_args, check_shared_prefix_args

_FLASH_ATTN_PAGE = 256  # flash-attn 2's paged kvcache kernel needs block_size % 256 == 0
BACKEND_ENV = "PARROT_ATTENTION_BACKEND"


def _forced_triton() -> bool:
    return os.environ.get(BACKEND_ENV) == "triton"


def uses_triton(device: torch.device) -> bool:
    """Whether tensors on `device` go to the Triton kernels (read per call, so tests may set it)."""
    return device.type == "cuda" or _forced_triton()


def _flash_attn_fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        q.is_cuda
        and not _forced_triton()
        and k_cache.shape[1] % _FLASH_ATTN_PAGE == 0
        and q.dtype in (torch.float16, torch.bfloat16)
        and importlib.util.find_spec("flash_attn") is not None
    )


def native_decode(q: torch.Tensor, k_cache: torch.Tensor) -> native.NativeKernels | None:
    """The C++ decode kernels when they take these CPU tensors (built here, dtype and head size they have)."""
    kernels = native.library()
    fits = q.dtype == k_cache.dtype and q.shape[1] % k_cache.shape[2] == 0
    if kernels is None or not fits or not kernels.supports(q.dtype, q.shape[-1], q.shape[1] // k_cache.shape[2]):
        return None
    return kernels


def write_kv(
    key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Store new tokens' keys/values [T, num_kv_heads, head_dim] into the caches, in place.

    slot_mapping [T] int32/int64: flat slot block_id * block_size + offset of each token;
    -1 skips the token (batch padding). Values are cast to the cache dtype.
    """
    check_kv_write_args(key, value, k_cache, v_cache, slot_mapping)
    if not uses_triton(key.device):
        kernels = native.library()
        if kernels is None or not kernels.write_kv(key, value, k_cache, v_cache, slot_mapping):
            cpu_attention.kv_write(key, value, k_cache, v_cache, slot_mapping)
        return
    from kernels.kv_write import kv_write

    kv_write(key, value, k_cache, v_cache, slot_mapping)


def decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    plan: cpu_attention.PaddedGather | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """One query token per sequence over its cached context -> [B, num_heads, head_dim].

    q [B, num_heads, head_dim]; block_tables [B, max_blocks]; context_lens [B], the number of
    cached tokens each query attends to (its own token included, i.e. written by write_kv first).
    A row with context_lens 0 (batch padding) comes out as zeros. With a sliding ``window``, each query
    attends to its last ``window`` tokens only; the blocks before them are not read.
    """
    check_decode_args(q, k_cache, v_cache, block_tables, context_lens)
    if not uses_triton(q.device):
        if kernels := native_decode(q, k_cache):
            if window is None:
                return kernels.decode(q, k_cache, v_cache, block_tables, context_lens, scale)
            rows = cpu_attention.windowed_decode_rows(block_tables, context_lens, window, k_cache.shape[1])
            return kernels.prepare_decode(rows.own_tables, rows.own_lens, firsts=rows.firsts)(q, k_cache, v_cache, scale)
        return cpu_attention.decode(q, k_cache, v_cache, block_tables, context_lens, scale, plan=plan, window=window)
    if _flash_attn_fits(q, k_cache) and window is None:
        from flash_attn import flash_attn_with_kvcache

        return flash_attn_with_kvcache(
            q.unsqueeze(1), k_cache, v_cache, cache_seqlens=context_lens, block_table=block_tables,
            softmax_scale=scale, causal=True,
        ).squeeze(1)
    from kernels.paged_decode import paged_decode

    return paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window=window)


def prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    max_seqlen_q: int,
    scale: float,
    plan: list[cpu_attention.PrefillChunk] | None = None,
    window: int | None = None,
) -> torch.Tensor:
    """Causal attention of packed new tokens over their sequences' caches -> [T, num_heads, head_dim]; with a
    sliding ``window``, each over the last ``window`` tokens up to itself.

    q [T, num_heads, head_dim] packs the new tokens of B sequences; cu_seqlens_q [B+1] int32 their
    cumulative counts; context_lens [B] each sequence's cached length including the new tokens
    (already written by write_kv), so a cached prefix of context_lens[b] - q_len tokens comes
    before them; max_seqlen_q is a host int bounding every q_len.
    """
    check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens)
    if not uses_triton(q.device):
        return cpu_attention.prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, plan=plan,
                                     native=native_decode(q, k_cache), window=window)
    from kernels.paged_prefill import paged_prefill

    return paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, max_seqlen_q, scale,
                         window=window)


def shared_prefix_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    prefix_ids: torch.Tensor,
    prefix_block_tables: torch.Tensor,
    prefix_lens: torch.Tensor,
    suffix_block_tables: torch.Tensor,
    suffix_lens: torch.Tensor,
    scale: float,
    plan: cpu_attention.SharedPrefixPlan | None = None,
) -> torch.Tensor:
    """Decode where sequences share prefixes whose KV is read once per prefix -> [B, num_heads, head_dim].

    Sequence b attends to shared prefix prefix_ids[b] (int32 in [-1, P); -1 means none), then to
    its own suffix. prefix_block_tables [P, max_prefix_blocks] and prefix_lens [P] describe the
    prefixes; suffix_block_tables [B, max_blocks] and suffix_lens [B] the suffixes (suffix token
    0 sits at offset 0 of the sequence's first suffix block, so a prefix may end mid-block).
    Equals decode_attention over the concatenated prefix ++ suffix context.
    """
    args = (q, k_cache, v_cache, prefix_ids, prefix_block_tables, prefix_lens, suffix_block_tables, suffix_lens, scale)
    check_shared_prefix_args(*args[:-1])
    if not uses_triton(q.device):
        if kernels := native_decode(q, k_cache):
            return kernels.shared_prefix_decode(*args)
        return cpu_attention.shared_prefix_decode(*args, plan=plan)
    from kernels.shared_prefix_decode import shared_prefix_decode

    return shared_prefix_decode(*args)
