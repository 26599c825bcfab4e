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

Layers with a sliding window (Gemma 2 and 3, Mistral, Phi-3), in a step where some sequence is longer than the
window, read the step's metadata for that window (``AttentionMetadata.windows``, made by the model runner once a
step for all such layers): the same rows, each decode on its own (no shared prefix: the window cuts it), their
tables starting at the block of each row's window's first key, so the kernels (C++, Triton, the torch paths)
never read a key before it and the blocks before may be freed (block_manager.py). Layers with soft-capped scores
(Gemma 2) run ``windowed_attention``, a torch path over the same metadata: each sequence's visible keys gathered
once per step and window (a ``WindowPlan``), then masked, capped attention in one batched call per layer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

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
    longest_context: int = 0  # the longest sequence's tokens, this step's included: whether a window cuts any
    decode: DecodeMetadata | None = None
    shared_prefix: SharedPrefixMetadata | None = None  # set instead of decode when groups pay
    prefill: PrefillMetadata | None = None
    # windowed_attention's plans, made by the first layer that needs one (by window; None: the whole context)
    window_plans: dict[int | None, WindowPlan] = field(default_factory=dict)
    window: int | None = None  # this metadata's sliding window (each query sees its last `window` keys), or None
    # The step's metadata for each sliding window shorter than its longest sequence (window set, kv_write None:
    # the keys are written once, through this one)
    windows: dict[int, AttentionMetadata] = field(default_factory=dict)


def paged_attention(
    q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
    k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim]
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
    if meta.kv_write is None or not meta.kv_write(k, v, k_cache, v_cache):
        dispatch.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    windowed = window is not None and meta.longest_context > window
    if softcap is not None or (windowed and window not in meta.windows):
        return windowed_attention(q, k_cache, v_cache, meta, scale, window, softcap)
    if windowed:
        meta = meta.windows[window]
    if meta.native is not None:
        return meta.native(q, k_cache, v_cache, scale)
    num_decodes = meta.num_decodes
    if meta.prefill is None:
        return _decode(q, k_cache, v_cache, meta, scale)
    prefill = meta.prefill
    prefilled = dispatch.prefill_attention(
        q[num_decodes:], k_cache, v_cache, prefill.block_tables, prefill.cu_seqlens_q, prefill.context_lens,
        prefill.max_seqlen_q, scale, prefill.plan, meta.window,
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
    return dispatch.decode_attention(q, k_cache, v_cache, decode.block_tables, decode.context_lens, scale, decode.plan,
                                     meta.window)


@dataclass
class WindowPlan:
    """One step's sequences padded to a common shape, for the keys a window lets them see."""

    query_rows: torch.Tensor  # [sequences, max_queries] the flat batch's row of each query (padding: 0)
    real_queries: torch.Tensor  # [sequences, max_queries] bool, False on padding
    key_slots: torch.Tensor  # [sequences, max_keys] cache slots of the visible keys (padding: 0)
    visible: torch.Tensor  # [sequences, 1, 1, max_queries, max_keys] bool: causal, within the window, not padding


def step_sequences(meta: AttentionMetadata, block_size: int) -> list[tuple[int, int, list[int], int]]:
    """(first row, rows, block table, context length with the rows) of each sequence in the step, in row order."""
    sequences = []
    if meta.shared_prefix is not None:
        shared = meta.shared_prefix
        prefix_tables, prefix_lens = shared.prefix_block_tables.tolist(), shared.prefix_lens.tolist()
        rows = zip(shared.prefix_ids.tolist(), shared.suffix_block_tables.tolist(), shared.suffix_lens.tolist())
        for row, (prefix, table, length) in enumerate(rows):
            prefix_len = prefix_lens[prefix] if prefix >= 0 else 0  # whole blocks
            prefix_blocks = prefix_tables[prefix][: prefix_len // block_size] if prefix >= 0 else []
            sequences.append((row, 1, [*prefix_blocks, *table], prefix_len + length))
    elif meta.decode is not None:
        decode = meta.decode
        for row, (table, length) in enumerate(zip(decode.block_tables.tolist(), decode.context_lens.tolist())):
            sequences.append((row, 1, table, length))
    if meta.prefill is not None:
        prefill = meta.prefill
        starts = prefill.cu_seqlens_q.tolist()
        for i, (table, length) in enumerate(zip(prefill.block_tables.tolist(), prefill.context_lens.tolist())):
            sequences.append((meta.num_decodes + starts[i], starts[i + 1] - starts[i], table, length))
    return sequences


def window_plan(meta: AttentionMetadata, block_size: int, window: int | None, device) -> WindowPlan:
    sequences = step_sequences(meta, block_size)
    max_queries = max(rows for _, rows, _, _ in sequences)
    spans = []  # (first visible key, context length) of each sequence
    for _, rows, _, length in sequences:
        first_query = length - rows
        spans.append((0 if window is None else max(0, first_query - window + 1), length))
    max_keys = max(length - first for first, length in spans)
    query_rows = torch.zeros(len(sequences), max_queries, dtype=torch.long)
    real = torch.zeros(len(sequences), max_queries, dtype=torch.bool)
    key_slots = torch.zeros(len(sequences), max_keys, dtype=torch.long)
    visible = torch.zeros(len(sequences), max_queries, max_keys, dtype=torch.bool)
    for i, ((row, rows, table, length), (first, _)) in enumerate(zip(sequences, spans)):
        query_rows[i, :rows] = torch.arange(row, row + rows)
        real[i, :rows] = True
        keys = torch.arange(first, length)
        key_slots[i, : len(keys)] = torch.tensor(table, dtype=torch.long)[keys // block_size] * block_size + keys % block_size
        queries = torch.arange(length - rows, length)[:, None]
        seen = keys[None, :] <= queries
        if window is not None:
            seen &= keys[None, :] > queries - window
        visible[i, :rows, : len(keys)] = seen
        visible[i, rows:, 0] = True  # padding queries see one key: no all-masked row to make NaNs
    return WindowPlan(query_rows.to(device), real.to(device), key_slots.to(device), visible[:, None, None].to(device))


def windowed_attention(q, k_cache, v_cache, meta: AttentionMetadata, scale: float, window: int | None,
                       softcap: float | None) -> torch.Tensor:
    """Causal attention of each row over its sequence's cached keys within ``window`` of it, scores capped at
    ``softcap`` (cap * tanh(score / cap)): transformers' eager attention, in its order of operations."""
    plan = meta.window_plans.get(window)
    if plan is None:
        plan = meta.window_plans[window] = window_plan(meta, k_cache.shape[1], window, q.device)
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    sequences, max_queries = plan.query_rows.shape
    queries = q[plan.query_rows].view(sequences, max_queries, num_kv_heads, num_heads // num_kv_heads, head_dim)
    keys = k_cache.flatten(0, 1)[plan.key_slots]  # [sequences, max_keys, kv_heads, head_dim]
    values = v_cache.flatten(0, 1)[plan.key_slots]
    scores = torch.einsum("bqkgd,blkd->bkgql", queries, keys) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~plan.visible, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    out = torch.einsum("bkgql,blkd->bqkgd", probs, values).reshape(sequences, max_queries, num_heads, head_dim)
    return out[plan.real_queries]
