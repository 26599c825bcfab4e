"""Attention over the paged KV cache, through ``kernels.dispatch`` (Triton on CUDA, C++ or torch on CPU).
Where the C++ kernels run, a step's KV writes and its whole attention (decodes and prefill chunks as one
call) run them with arguments the model runner prepared once for all layers
(``kernels.native.PreparedDecode``): dispatch's checks and conversions, repeated in each layer, cost more
than a batch-1 decode's own work, and a call per chunk left threads idle (16 chunks over one cached
prompt: three tasks a call for two threads).

Cache layout (the kernels in ``kernels/`` code against it): per layer ``k_cache`` and
``v_cache`` of shape [num_blocks, block_size, num_kv_heads, head_dim]; the cache row of a token
is its slot, ``block_id * block_size + offset``.

The flat batch holds decode tokens first, then the prefill chunks. ``AttentionMetadata`` is
built once per step by the model runner and shared by every layer; so are, on CPU, the plans of
what the torch paths read of it (lengths on the host, gather indices, masks). Decodes whose
sequences share leading KV blocks (forks of one context, prefix-cache hits) carry prefix groups,
and then go through the shared-prefix kernel, which reads each shared prefix's KV once for its
group.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kernels import dispatch
from kernels.cpu_attention import PaddedGather, PrefillChunk, SharedPrefixPlan
from kernels.native import PreparedDecode, PreparedKvWrite


@dataclass
class DecodeMetadata:
    block_tables: torch.Tensor  # [num_decodes, max_blocks] int32
    context_lens: torch.Tensor  # [num_decodes] int32, the new token included
    plan: PaddedGather | None = None  # the CPU path's reads of the above, made once for all layers


@dataclass
class SharedPrefixMetadata:
    prefix_ids: torch.Tensor  # [num_decodes] int32, -1: no shared prefix
    prefix_block_tables: torch.Tensor  # [num_prefixes, max_prefix_blocks] int32
    prefix_lens: torch.Tensor  # [num_prefixes] int32
    suffix_block_tables: torch.Tensor  # [num_decodes, max_suffix_blocks] int32
    suffix_lens: torch.Tensor  # [num_decodes] int32
    plan: SharedPrefixPlan | None = None


@dataclass
class PrefillMetadata:
    block_tables: torch.Tensor  # [num_prefills, max_blocks] int32
    cu_seqlens_q: torch.Tensor  # [num_prefills + 1] int32, rows of each chunk after the decodes
    context_lens: torch.Tensor  # [num_prefills] int32, cached prefix + chunk
    max_seqlen_q: int
    plan: list[PrefillChunk] | None = None


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's key/value is stored
    kv_write: PreparedKvWrite | None = None  # the C++ kernel's writes at slot_mapping, made once for all layers
    native: PreparedDecode | None = None  # the C++ kernel over all the step's rows, made once for all layers
    num_decodes: int = 0
    decode: DecodeMetadata | None = None
    shared_prefix: SharedPrefixMetadata | None = None  # set instead of decode when groups pay
    prefill: PrefillMetadata | None = None


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if meta.kv_write is None or not meta.kv_write(k, v, k_cache, v_cache):
        dispatch.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.native is not None:
        return meta.native(q, k_cache, v_cache, scale)
    num_decodes = meta.num_decodes
    if meta.prefill is None:
        return _decode(q, k_cache, v_cache, meta, scale)
    prefill = meta.prefill
    prefilled = dispatch.prefill_attention(
        q[num_decodes:], k_cache, v_cache, prefill.block_tables, prefill.cu_seqlens_q, prefill.context_lens,
        prefill.max_seqlen_q, scale, prefill.plan,
    )
    if not num_decodes:
        return prefilled
    return torch.cat([_decode(q[:num_decodes], k_cache, v_cache, meta, scale), prefilled])


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    shared = meta.shared_prefix
    if shared is not None:
        return dispatch.shared_prefix_decode_attention(
            q, k_cache, v_cache, shared.prefix_ids, shared.prefix_block_tables, shared.prefix_lens,
            shared.suffix_block_tables, shared.suffix_lens, scale, shared.plan,
        )
    decode = meta.decode
    return dispatch.decode_attention(q, k_cache, v_cache, decode.block_tables, decode.context_lens, scale, decode.plan)
