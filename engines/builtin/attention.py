"""Attention over the paged KV cache.

Cache layout (the kernels in ``kernels/`` code against it): per layer ``k_cache`` and
``v_cache`` of shape [num_blocks, block_size, num_kv_heads, head_dim]; the cache row of a token
is its slot, ``block_id * block_size + offset``.

The CPU path gathers each sequence's keys and values through precomputed slot indices and runs
torch SDPA; the indices and masks are built once per step (``AttentionMetadata``) and shared by
every layer. The flat batch holds decode tokens first, then one span per prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class PrefillSpan:
    start: int  # first row of the chunk in the flat batch
    end: int
    # None when the chunk starts the sequence: attend causally to the chunk's own keys, no gather.
    context_slots: torch.Tensor | None = None  # [context_len] slots of every key, cached prefix + chunk
    mask: torch.Tensor | None = None  # [chunk_len, context_len] bool, causal shifted by the prefix


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [num_tokens] where each new token's key/value is stored
    num_decodes: int = 0
    decode_slots: torch.Tensor | None = None  # [num_decodes, max_context_len], padded with slot 0
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, max_context_len] True for real keys
    prefills: list[PrefillSpan] = field(default_factory=list)


def store_kv(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: torch.Tensor) -> None:
    # k, v: [num_tokens, num_kv_heads, head_dim]
    k_cache.view(-1, *k.shape[1:]).index_copy_(0, slots, k)
    v_cache.view(-1, *v.shape[1:]).index_copy_(0, slots, v)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    if meta.num_decodes == q.shape[0]:
        return _decode(q, k_cache, v_cache, meta, scale)
    out = torch.empty_like(q)
    if meta.num_decodes:
        out[: meta.num_decodes] = _decode(q[: meta.num_decodes], k_cache, v_cache, meta, scale)
    for span in meta.prefills:
        out[span.start : span.end] = _prefill(q, k, v, k_cache, v_cache, span, scale)
    return out


def _decode(q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    # The query heads of one kv head become that head's "query positions": plain multi-head SDPA
    # over un-repeated keys, no GQA expansion of the gathered cache.
    q = q[: meta.num_decodes].view(batch, num_kv_heads, group, head_dim)
    keys = k_cache.view(-1, num_kv_heads, head_dim)[meta.decode_slots].transpose(1, 2)  # [B, kvh, L, d]
    values = v_cache.view(-1, num_kv_heads, head_dim)[meta.decode_slots].transpose(1, 2)
    out = F.scaled_dot_product_attention(q, keys, values, attn_mask=meta.decode_mask, scale=scale)
    return out.reshape(batch, num_heads, head_dim)


def _prefill(q, k, v, k_cache, v_cache, span: PrefillSpan, scale: float) -> torch.Tensor:
    q = q[span.start : span.end].transpose(0, 1)  # [h, chunk, d]
    if span.context_slots is None:
        keys = k[span.start : span.end].transpose(0, 1)  # [kvh, chunk, d]
        values = v[span.start : span.end].transpose(0, 1)
        out = F.scaled_dot_product_attention(q, keys, values, is_causal=True, scale=scale, enable_gqa=True)
    else:
        num_kv_heads, head_dim = k_cache.shape[2:]
        keys = k_cache.view(-1, num_kv_heads, head_dim)[span.context_slots].transpose(0, 1)  # [kvh, L, d]
        values = v_cache.view(-1, num_kv_heads, head_dim)[span.context_slots].transpose(0, 1)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=span.mask, scale=scale, enable_gqa=True)
    return out.transpose(0, 1)
