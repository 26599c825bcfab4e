"""Plain-torch references for every kernel: one sequence at a time, fp32 softmax, no tricks.

They define what the kernels compute and are what the tests compare against; speed is irrelevant.
Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; token t of a sequence lives in
block block_table[t // block_size] at offset t % block_size.
"""

from __future__ import annotations

import torch


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence, [length, num_kv_heads, head_dim]."""
    block_size = cache.shape[1]
    positions = torch.arange(length, device=cache.device)
    blocks = block_table[positions // block_size].long()
    return cache[blocks, positions % block_size]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None = None):
    """Softmax attention in fp32 with GQA; q [n, H, D], k/v [L, KVH, D], mask [n, L] (True = keep).

    Returns (out [n, H, D] fp32, lse [n, H] natural-log log-sum-exp of the scaled scores).
    """
    group = q.shape[1] // k.shape[1]
    k = k.float().repeat_interleave(group, dim=1)  # [L, H, D]
    v = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), k) * scale  # [H, n, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)  # [H, n]
    out = torch.einsum("hnl,lhd->nhd", torch.softmax(scores, dim=-1), v)
    return out, lse.transpose(0, 1)


def visible(positions: torch.Tensor, length: int, window: int | None) -> torch.Tensor:
    """[n, length] True where the query at positions[i] sees key j: causal, and with a sliding ``window`` only the
    last ``window`` keys up to itself (``j > position - window``, as transformers masks)."""
    keys = torch.arange(length, device=positions.device)[None, :]
    seen = keys <= positions[:, None]
    return seen if window is None else seen & (keys > positions[:, None] - window)


def paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale, window: int | None = None):
    """q [B, H, D] -> [B, H, D]: each sequence's query over its cached context (its last ``window`` tokens)."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        length = int(context_lens[b])
        if length == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], length)
        v = gather_kv(v_cache, block_tables[b], length)
        mask = visible(torch.tensor([length - 1], device=q.device), length, window)
        out[b] = attend(q[b : b + 1], k, v, scale, mask)[0][0].to(q.dtype)
    return out


def paged_prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, window: int | None = None):
    """q [T, H, D] packed new tokens -> [T, H, D]: causal attention over prefix + new tokens (with a sliding
    ``window``, each query over the last ``window`` of them up to itself).

    Sequence b owns q rows cu_seqlens_q[b]:cu_seqlens_q[b+1]; its context (already in the cache,
    new tokens included) has context_lens[b] tokens, so its new tokens sit at the end of it.
    """
    out = torch.zeros_like(q)
    for b in range(len(context_lens)):
        start, end, length = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(context_lens[b])
        if end == start:
            continue
        k = gather_kv(k_cache, block_tables[b], length)
        v = gather_kv(v_cache, block_tables[b], length)
        positions = torch.arange(length - (end - start), length, device=q.device)
        mask = visible(positions, length, window)
        out[start:end] = attend(q[start:end], k, v, scale, mask)[0].to(q.dtype)
    return out


def shared_prefix_decode(
    q, k_cache, v_cache, prefix_ids, prefix_block_tables, prefix_lens, suffix_block_tables, suffix_lens, scale
):
    """Decode where sequence b's context is shared prefix prefix_ids[b] (-1: none) then its own suffix."""
    out = torch.zeros_like(q)
    for b in range(q.shape[0]):
        parts_k, parts_v = [], []
        prefix = int(prefix_ids[b])
        if prefix >= 0:
            length = int(prefix_lens[prefix])
            parts_k.append(gather_kv(k_cache, prefix_block_tables[prefix], length))
            parts_v.append(gather_kv(v_cache, prefix_block_tables[prefix], length))
        parts_k.append(gather_kv(k_cache, suffix_block_tables[b], int(suffix_lens[b])))
        parts_v.append(gather_kv(v_cache, suffix_block_tables[b], int(suffix_lens[b])))
        k, v = torch.cat(parts_k), torch.cat(parts_v)
        if k.shape[0]:
            out[b] = attend(q[b : b + 1], k, v, scale)[0][0].to(q.dtype)
    return out


def kv_write(key, value, k_cache, v_cache, slot_mapping):
    """In place: token i's key/value [KVH, D] go to flat slot slot_mapping[i]; slot -1 is skipped."""
    block_size = k_cache.shape[1]
    for i, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        k_cache[slot // block_size, slot % block_size] = key[i]
        v_cache[slot // block_size, slot % block_size] = value[i]
