"""The torch paths dispatch uses where Triton cannot run (CPU tensors).

On CPU a host sync is free, so these read lengths back freely and gather each batch's KV into
padded dense tensors; `benchmarks/kernels.py --cpu` compares them with the alternatives (a
per-sequence SDPA loop, a hand-written einsum softmax) and they are the fastest measured there.
KV is gathered whole blocks at a time with index_select: on CPU that is 5-8x faster than
advanced indexing by block or slot.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def gather_padded(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """First max_len tokens of every sequence, [B, KVH, max_len, D] (tokens past a length are junk)."""
    block_size = cache.shape[1]
    blocks = block_tables[:, : -(-max_len // block_size)].clamp(min=0)  # [B, n]; padding may be -1
    rows = cache.index_select(0, blocks.flatten()).view(blocks.shape[0], -1, *cache.shape[2:])  # [B, n*bs, KVH, D]
    return rows[:, :max_len].transpose(1, 2)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence, [length, KVH, D]."""
    blocks = block_table[: -(-length // cache.shape[1])]
    return cache.index_select(0, blocks).flatten(0, 1)[:length]


def length_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] True where a position is inside its sequence."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def decode(q, k_cache, v_cache, block_tables, context_lens, scale, *, out=None):
    """q [B, H, D] -> [B, H, D], zero rows where context_lens is 0.

    One padded-batch SDPA call with each kv head's query heads as its query rows. With GQA
    through enable_gqa instead, masked bf16 SDPA was 1.5-2x slower than one call per sequence;
    grouped this way it is 2-5x faster than that loop in bf16 too (16 sequences, ~230 tokens).
    """
    return decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, out)


def decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, out=None):
    lens = context_lens.tolist()
    max_len, min_len = max(lens, default=0), min(lens, default=0)
    if max_len == 0:
        return torch.zeros_like(q) if out is None else out.zero_()
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k = gather_padded(k_cache, block_tables, max_len)  # [B, KVH, L, D]
    v = gather_padded(v_cache, block_tables, max_len)
    mask = None if min_len == max_len else length_mask(context_lens, max_len)[:, None, None, :]  # [B, 1, 1, L]
    # A kv head's query heads become its query rows: SDPA over un-repeated keys, faster on CPU
    # than enable_gqa, which expands the gathered KV.
    grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    attended = F.scaled_dot_product_attention(grouped, k, v, attn_mask=mask, scale=scale)
    attended = attended.reshape(batch, num_heads, head_dim)
    if min_len == 0:
        attended[context_lens == 0] = 0  # an all-masked row is NaN in SDPA
    return attended if out is None else out.copy_(attended)


def decode_per_sequence(q, k_cache, v_cache, block_tables, context_lens, scale, out):
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], length).transpose(0, 1)  # [KVH, L, D]
        v = gather_kv(v_cache, block_tables[b], length).transpose(0, 1)
        attended = F.scaled_dot_product_attention(q[b].unsqueeze(1), k, v, scale=scale, enable_gqa=True)
        out[b] = attended.squeeze(1)
    return out


def prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, *, out=None):
    """Per-sequence SDPA over the gathered context, causal mask aligned to the context's end.

    Inputs go in as 4-D [1, heads, tokens, D]: torch's fused (flash) CPU kernel takes only 4-D
    inputs, 3-D ones fall back to the materialised-scores math path, 5x slower for a 1,000-token
    causal prefill here (bf16 and fp32) and 1.2-2x for a chunk over a cached prefix.
    """
    out = torch.empty_like(q) if out is None else out
    bounds = cu_seqlens_q.tolist()
    for b, length in enumerate(context_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        k = gather_kv(k_cache, block_tables[b], length).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = gather_kv(v_cache, block_tables[b], length).transpose(0, 1).unsqueeze(0)
        queries = q[start:end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if end - start == length:  # no cached prefix: the plain causal kernel
            attended = F.scaled_dot_product_attention(queries, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            positions = torch.arange(length - (end - start), length, device=q.device)
            mask = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [n, L]
            attended = F.scaled_dot_product_attention(queries, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        out[start:end] = attended[0].transpose(0, 1)
    return out


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """q [B, KVH, R, D] (R query rows per kv head), k/v [B, KVH, L, D], mask [B, 1, 1, L]
    -> (out [B, KVH, R, D] fp32, lse [B, KVH, R] natural log; -inf for rows with no keys)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, KVH, R, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min).unsqueeze(-1))
    return torch.matmul(probs, v.float()), lse


def shared_prefix_decode(
    q, k_cache, v_cache, prefix_ids, prefix_block_tables, prefix_lens, suffix_block_tables, suffix_lens, scale,
    *, out=None,
):
    """Each prefix's KV gathered once and scored by all its sequences in one matmul. A row's
    prefix and suffix scores go through one softmax together, so there is nothing to merge
    afterwards (as fast here as two log-sum-exp passes and a merge, with less to get wrong)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    grouped_q = q.float().view(batch, num_kv_heads, group, head_dim)

    lens = suffix_lens.tolist()
    max_suffix = max(lens, default=0)
    k = gather_padded(k_cache, suffix_block_tables, max_suffix).float()  # [B, KVH, Ls, D]
    v = gather_padded(v_cache, suffix_block_tables, max_suffix).float()
    suffix_scores = torch.matmul(grouped_q, k.transpose(-1, -2)) * scale  # [B, KVH, G, Ls]
    suffix_scores.masked_fill_(~length_mask(suffix_lens, max_suffix)[:, None, None, :], float("-inf"))

    members: dict[int, list[int]] = {}
    for row, prefix in enumerate(prefix_ids.tolist()):
        members.setdefault(prefix, []).append(row)
    prefix_lengths = prefix_lens.tolist()
    attended = torch.empty(batch, num_kv_heads, group, head_dim)
    for prefix, rows in members.items():
        length = prefix_lengths[prefix] if prefix >= 0 else 0
        index = torch.tensor(rows)
        if length == 0:
            attended[index] = torch.matmul(torch.softmax(suffix_scores[index], -1), v[index])
            continue
        n = len(rows)
        pk = gather_kv(k_cache, prefix_block_tables[prefix], length).transpose(0, 1).float()  # [KVH, Lp, D]
        pv = gather_kv(v_cache, prefix_block_tables[prefix], length).transpose(0, 1).float()
        queries = grouped_q[index].transpose(0, 1).reshape(num_kv_heads, n * group, head_dim)
        prefix_scores = torch.matmul(queries, pk.transpose(-1, -2)) * scale  # [KVH, n*G, Lp]
        own_scores = suffix_scores[index].transpose(0, 1).reshape(num_kv_heads, n * group, max_suffix)
        probs = torch.softmax(torch.cat([prefix_scores, own_scores], -1), -1)  # [KVH, n*G, Lp + Ls]
        from_prefix = torch.matmul(probs[..., :length], pv).view(num_kv_heads, n, group, head_dim).transpose(0, 1)
        own_probs = probs[..., length:].reshape(num_kv_heads, n, group, max_suffix).transpose(0, 1)
        attended[index] = from_prefix + torch.matmul(own_probs, v[index])
    if min(lens, default=1) == 0:
        attended = attended.nan_to_num(0.0)  # rows with no keys at all: softmax of all -inf
    merged = attended.reshape(batch, num_heads, head_dim).to(q.dtype)
    return merged if out is None else out.copy_(merged)


def kv_write(key, value, k_cache, v_cache, slot_mapping):
    """In place; slot -1 skipped. index_copy_ is several times cheaper than an indexed store."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))
