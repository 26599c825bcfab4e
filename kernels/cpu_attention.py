"""The torch paths dispatch uses where Triton cannot run (CPU tensors): prefill always; decode and
KV writes where the C++ kernels (kernels/native.py), faster on decode, are not built.

On CPU a host sync is free, so these read lengths back freely and gather each batch's KV into
padded dense tensors; `benchmarks/kernels.py --cpu` compares them with the alternatives (a
per-sequence SDPA loop, a hand-written einsum softmax) and they are the fastest measured there.
KV is gathered whole blocks at a time with index_select: on CPU that is several times faster than
advanced indexing by block or slot.

What a path reads of a step's lengths and block tables (host reads, gather indices, masks) is the
same for every layer, so the engine works it out once per step as a plan (``plan_decode``,
``plan_prefill``, ``plan_shared_prefix``) and passes it to each layer's call; without a plan, a call
makes its own. Planning once shortens a decode step's attention, more at small batches (`python -m
benchmarks.kernels --cpu`, its "decode step" rows; the figures: docs/engine.md, "Measurements behind design
choices").
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from kernels import native


@dataclass(frozen=True)
class PaddedGather:
    """The first ``max_len`` tokens of each of ``rows`` sequences, as whole blocks to gather."""

    rows: int
    max_len: int
    blocks: torch.Tensor  # [rows * n] the first n blocks of each row, flattened; padding -1 clamped to 0
    mask: torch.Tensor | None  # [rows, 1, 1, max_len] True inside a row's length; None when all are max_len
    any_empty: bool  # some row has no tokens (its softmax would be NaN)


def plan_decode(block_tables: torch.Tensor, lengths: torch.Tensor, block_size: int,
                window: int | None = None) -> PaddedGather:
    """The padded gather of the first ``lengths`` tokens of each row (decodes, and shared-prefix suffixes); with
    a sliding ``window``, of each row's last ``window`` (from its window's block, the keys before it masked)."""
    firsts = None
    if window is not None and len(lengths) and int(lengths.max()) > window:
        rows = windowed_decode_rows(block_tables, lengths, window, block_size)
        block_tables, lengths, firsts = rows.own_tables, rows.own_lens, rows.firsts
    lens = lengths.tolist()
    max_len, min_len = max(lens, default=0), min(lens, default=0)
    blocks = block_tables[:, : -(-max_len // block_size)].clamp(min=0).flatten()
    mask = None if min_len == max_len and firsts is None else length_mask(lengths, max_len)
    if firsts is not None:
        mask = mask & (torch.arange(max_len)[None, :] >= firsts[:, None])
    return PaddedGather(len(lens), max_len, blocks, None if mask is None else mask[:, None, None, :], min_len == 0)


def gather(cache: torch.Tensor, plan: PaddedGather) -> torch.Tensor:
    """[rows, KVH, max_len, D] (tokens past a row's length are junk)."""
    rows = cache.index_select(0, plan.blocks).view(plan.rows, -1, *cache.shape[2:])  # [B, n*bs, KVH, D]
    return rows[:, : plan.max_len].transpose(1, 2)


def gather_padded(cache: torch.Tensor, block_tables: torch.Tensor, max_len: int) -> torch.Tensor:
    """First max_len tokens of every sequence, [B, KVH, max_len, D] (tokens past a length are junk)."""
    lengths = torch.full((block_tables.shape[0],), max_len)
    return gather(cache, plan_decode(block_tables, lengths, cache.shape[1]))


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int) -> torch.Tensor:
    """The first `length` tokens of one sequence, [length, KVH, D]."""
    return _sequence_kv(cache, block_table[: -(-length // cache.shape[1])], length)


def length_mask(lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B, max_len] True where a position is inside its sequence."""
    return torch.arange(max_len, device=lengths.device)[None, :] < lengths[:, None]


def decode(q, k_cache, v_cache, block_tables, context_lens, scale, *, out=None, plan: PaddedGather | None = None,
           window: int | None = None):
    """q [B, H, D] -> [B, H, D], zero rows where context_lens is 0; with a sliding ``window``, each over its last
    ``window`` tokens.

    One padded-batch SDPA call with each kv head's query heads as its query rows. With GQA
    through enable_gqa instead, masked bf16 SDPA was slower than one call per sequence;
    grouped this way it is several times faster than that loop in bf16 too.
    """
    return decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, out, plan, window)


def decode_padded(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, plan=None, window=None):
    plan = plan or plan_decode(block_tables, context_lens, k_cache.shape[1], window)
    if plan.max_len == 0:
        return torch.zeros_like(q) if out is None else out.zero_()
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    k, v = gather(k_cache, plan), gather(v_cache, plan)  # [B, KVH, L, D]
    # A kv head's query heads become its query rows: SDPA over un-repeated keys, faster on CPU
    # than enable_gqa, which expands the gathered KV.
    grouped = q.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    attended = F.scaled_dot_product_attention(grouped, k, v, attn_mask=plan.mask, scale=scale)
    attended = attended.reshape(batch, num_heads, head_dim)
    if plan.any_empty:
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


@dataclass(frozen=True)
class NativeRows:
    """Query rows as the native kernel takes them: each row attends to a prefix (or none), then its own run.

    A prefill chunk's new tokens go in tiles of ``native_tile_tokens()``, each tile a prefix (join_rows then gives
    tiles over the same blocks one): a tile's rows read
    the whole blocks before its first token once, together, then each row its own few tokens up to itself
    (causal). A decode's row has its context as its own run, or a shared prefix and its suffix.
    """

    prefix_ids: torch.Tensor  # [n] each row's prefix (a tile, a shared prefix), -1: none
    prefix_table: torch.Tensor  # [prefixes, blocks] each prefix's blocks
    prefix_len: torch.Tensor  # [prefixes] tokens in each prefix
    own_tables: torch.Tensor  # [n, blocks] the blocks after row j's prefix
    own_lens: torch.Tensor  # [n] tokens row j reads past its prefix, itself included
    # [n] a sliding window's first key of row j, counted from its prefix's first token (its own run's without one):
    # the keys before it are not attended (the rows' tables start at the window's block); None: no window
    firsts: torch.Tensor | None = None


def decode_rows(block_tables: torch.Tensor, context_lens: torch.Tensor,
                prefixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> NativeRows:
    """Decodes as rows: each over its block table's context, or (``prefixes``: prefix_ids, prefix tables,
    prefix lengths) over its shared prefix and then its suffix (block_tables and context_lens are then the suffixes')."""
    if prefixes is None:
        prefixes = (torch.full((len(context_lens),), -1, dtype=torch.int32), block_tables[:0], context_lens[:0])
    return NativeRows(*prefixes, block_tables, context_lens)


def windowed_decode_rows(block_tables: torch.Tensor, context_lens: torch.Tensor, window: int,
                         block_size: int) -> NativeRows:
    """Decodes as rows over only their last ``window`` tokens: each row's table starts at the block holding its
    window's first key (the blocks before are never read, so they may be freed), ``firsts`` that key's offset in it."""
    lens = context_lens.long()
    first_key = (lens - window).clamp(min=0)
    skipped = first_key // block_size
    own_lens = lens - skipped * block_size
    width = max(1, -(-int(own_lens.max()) // block_size)) if len(lens) else 1
    index = (skipped[:, None] + torch.arange(width)[None, :]).clamp_max(block_tables.shape[1] - 1)
    return NativeRows(torch.full((len(lens),), -1, dtype=torch.int32), block_tables[:0], context_lens[:0],
                      block_tables.gather(1, index), own_lens.to(torch.int32),
                      (first_key - skipped * block_size).to(torch.int32))


def join_rows(parts: list[NativeRows], block_size: int) -> NativeRows:
    """One step's rows in one layout, in the order given (the step's tokens: decodes, then prefill chunks), for
    one kernel call a layer: the chunks' tiles and the decodes share the call's threads, and its Python cost is
    paid once, not once a chunk. Prefixes of the same blocks are then one (_same_prefixes_shared; ``block_size``:
    the cache's, which says how many of a prefix's table entries it reads)."""
    return _same_prefixes_shared(concatenated_rows(parts), block_size)


def concatenated_rows(parts: list[NativeRows]) -> NativeRows:
    """The parts' rows one after another, each part's prefixes with ids of their own. Tables are padded with
    block 0, never read past a row's length."""
    if len(parts) == 1:
        return parts[0]
    offsets = torch.tensor([0] + [len(part.prefix_len) for part in parts]).cumsum(0).tolist()
    ids = [torch.where(part.prefix_ids < 0, part.prefix_ids, part.prefix_ids + offset)
           for part, offset in zip(parts, offsets)]
    windowed = any(part.firsts is not None for part in parts)
    return NativeRows(
        prefix_ids=torch.cat(ids).to(torch.int32),
        prefix_table=_padded_rows([part.prefix_table for part in parts]),
        prefix_len=torch.cat([part.prefix_len for part in parts]).to(torch.int32),
        own_tables=_padded_rows([part.own_tables for part in parts]),
        own_lens=torch.cat([part.own_lens for part in parts]).to(torch.int32),
        firsts=torch.cat([torch.zeros(len(part.own_lens), dtype=torch.int32) if part.firsts is None else part.firsts
                          for part in parts]).to(torch.int32) if windowed else None,
    )


def _same_prefixes_shared(rows: NativeRows, block_size: int) -> NativeRows:
    """The rows with each prefix id remapped to the first prefix of the same length over the same blocks: the
    kernel then groups those rows into shared tiles and reads the blocks once a tile. A step's prefill chunks over
    one cached prompt (forks' first chunks after a shared system prompt) each had a tile of their own, which
    read all the prompt's keys and values for a few rows (``python -m benchmarks.fork_prefill`` measures it).
    Prefixes that only begin alike (a fork's own cached block after the shared
    ones) stay apart."""
    lengths = rows.prefix_len.tolist()
    with_length: dict[int, list[int]] = {}
    for prefix_id, length in enumerate(lengths):
        if length > 0:  # empty prefixes have nothing to share: merged, they would only pack chunks into fewer tasks
            with_length.setdefault(length, []).append(prefix_id)
    shared_id, merged = list(range(len(lengths))), False
    for length, prefix_ids in with_length.items():
        if len(prefix_ids) < 2:  # a chunk's tiles have lengths of their own: most steps compare no tables
            continue
        # Only the blocks the length covers: _tiled_rows gives every tile of a chunk its last tile's table.
        tables = rows.prefix_table[prefix_ids, : -(-length // block_size)].tolist()
        first_with: dict[tuple[int, ...], int] = {}
        for prefix_id, table in zip(prefix_ids, tables):
            shared_id[prefix_id] = first_with.setdefault(tuple(table), prefix_id)
            merged |= shared_id[prefix_id] != prefix_id
    if not merged:
        return rows
    shared_id.append(-1)  # a row with no prefix (-1) indexes the last
    return replace(rows, prefix_ids=torch.tensor(shared_id, dtype=torch.int32)[rows.prefix_ids.long()])


def _padded_rows(tables: list[torch.Tensor]) -> torch.Tensor:
    width = max(1, max(table.shape[1] for table in tables))
    return torch.cat([F.pad(table, (0, width - table.shape[1])) for table in tables]).to(torch.int32)


@dataclass(frozen=True)
class PrefillChunk:
    """One sequence's new tokens: rows start:end of q, over the first ``length`` tokens of its cache."""

    start: int
    end: int
    length: int
    blocks: torch.Tensor  # the blocks holding those ``length`` tokens
    cached_rows: NativeRows | None = None  # the chunk in tiles, for the native kernel (native_dtype)
    window: int | None = None  # a sliding window: each query sees only the last ``window`` tokens up to itself

    @property
    def first_key(self) -> int:
        """The first key any of the chunk's queries sees (its first query's window's first)."""
        return 0 if self.window is None else max(0, self.length - (self.end - self.start) - self.window + 1)

    @functools.cached_property
    def mask(self) -> torch.Tensor | None:
        """[end - start, length - first_key] over keys from first_key: causal over a cached prefix, and within the
        window; None: no cached prefix and no window cutting the keys (plain causal). Made on first use (the
        torch path's; a chunk the native kernel takes never needs it), then shared by every layer."""
        n = self.end - self.start
        windowed = self.window is not None and self.length > self.window
        if n == self.length and not windowed:
            return None
        positions = torch.arange(self.length - n, self.length)[:, None]
        keys = torch.arange(self.first_key, self.length)[None, :]
        return (keys <= positions) & (keys > positions - self.window) if windowed else keys <= positions


def native_tile_tokens() -> int:
    """The tokens of a chunk the native kernel takes a tile: with SmolLM2's 3 query heads per kv head, its
    widest tile (native.MAX_GROUP, the kernel's kTileRows: 96 query rows) shares each key and value read."""
    return native.MAX_GROUP // 3


def plan_prefill(block_tables, cu_seqlens_q, context_lens, block_size: int, *,
                 native_dtype: torch.dtype | None = None, window: int | None = None) -> list[PrefillChunk]:
    """``native_dtype`` (the native kernel's dtype, or None): also lay each chunk out in the kernel's tiles (one
    size for every dtype). ``window``: a sliding window's (the tiles' tables then start at their window's block)."""
    bounds, chunks = cu_seqlens_q.tolist(), []
    for b, length in enumerate(context_lens.tolist()):
        start, end = bounds[b], bounds[b + 1]
        if end == start:
            continue
        blocks = block_tables[b, : -(-length // block_size)]
        cached_rows = (None if native_dtype is None else
                       _tiled_rows(blocks, length - (end - start), end - start, block_size, native_tile_tokens(), window))
        chunks.append(PrefillChunk(start, end, length, blocks, cached_rows, window))
    return chunks


def _tiled_rows(blocks: torch.Tensor, cached: int, n: int, block_size: int, tile: int,
                window: int | None = None) -> NativeRows:
    tiles = -(-n // tile)
    tile_of_row = torch.arange(n) // tile
    tile_starts = cached + torch.arange(tiles) * tile  # each tile's first query's position
    whole = tile_starts // block_size  # whole blocks before each tile
    own_start = whole[tile_of_row]  # the block each row's own tokens start in
    own_lens = cached + torch.arange(1, n + 1) - own_start * block_size
    # Host ints from the host ints it was given (no reads of the tensors above): the longest own run is a
    # tile's last row's.
    own_blocks = max(-(-(cached + min(n, (t + 1) * tile) - (cached + t * tile) // block_size * block_size)
                       // block_size) for t in range(tiles))
    own_index = (own_start[:, None] + torch.arange(own_blocks)[None, :]).clamp_max(len(blocks) - 1)
    if window is not None:
        return _windowed_tiles(blocks, cached, n, block_size, tile_of_row, tile_starts, window,
                               own_tables=blocks[own_index].contiguous(), own_lens=own_lens.to(torch.int32))
    return NativeRows(
        prefix_ids=tile_of_row.to(torch.int32),
        prefix_table=blocks[: (cached + (tiles - 1) * tile) // block_size][None].expand(tiles, -1).contiguous(),
        prefix_len=(whole * block_size).to(torch.int32),
        own_tables=blocks[own_index].contiguous(),
        own_lens=own_lens.to(torch.int32),
    )


def _windowed_tiles(blocks, cached: int, n: int, block_size: int, tile_of_row, tile_starts, window: int,
                    own_tables, own_lens) -> NativeRows:
    """_tiled_rows' tiles under a sliding window: a tile's prefix starts at the block of its first query's window's
    first key (the blocks before are never read), each row's ``firsts`` its own window's first key from there."""
    whole = tile_starts // block_size
    skipped = torch.minimum((tile_starts - window + 1).clamp(min=0) // block_size, whole)
    width = max(1, int((whole - skipped).max()))
    prefix_index = (skipped[:, None] + torch.arange(width)[None, :]).clamp_max(len(blocks) - 1)
    positions = cached + torch.arange(n)
    firsts = ((positions - window + 1).clamp(min=0) - skipped[tile_of_row] * block_size).clamp(min=0)
    return NativeRows(
        prefix_ids=tile_of_row.to(torch.int32),
        prefix_table=blocks[prefix_index].contiguous(),
        prefix_len=((whole - skipped) * block_size).to(torch.int32),
        own_tables=own_tables,
        own_lens=own_lens,
        firsts=firsts.to(torch.int32),
    )


def prefill(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, *, out=None,
            plan: list[PrefillChunk] | None = None, native=None, window: int | None = None):
    """Per-sequence SDPA over the gathered context, causal mask aligned to the context's end; with
    ``native`` (kernels/native.py), chunks planned in tiles go through its kernel instead (faster on a long
    bf16 prefill, as accurate against an fp64 reference).

    Inputs go in as 4-D [1, heads, tokens, D]: torch's fused (flash) CPU kernel takes only 4-D
    inputs, 3-D ones fall back to the materialised-scores math path, several times slower for a long
    causal prefill (bf16 and fp32) and slower for a chunk over a cached prefix too.
    """
    out = torch.empty_like(q) if out is None else out
    plan = plan if plan is not None else plan_prefill(block_tables, cu_seqlens_q, context_lens, k_cache.shape[1],
                                                      native_dtype=q.dtype if native is not None else None,
                                                      window=window)
    for chunk in plan:
        if native is not None and chunk.cached_rows is not None:
            rows = chunk.cached_rows
            prepared = native.prepare_decode(rows.own_tables, rows.own_lens,
                                             (rows.prefix_ids, rows.prefix_table, rows.prefix_len), rows.firsts)
            out[chunk.start : chunk.end] = prepared(q[chunk.start : chunk.end], k_cache, v_cache, scale)
            continue
        # The keys from the first any query's window sees, gathered from its block (those before may be freed).
        skipped = chunk.first_key // k_cache.shape[1]
        blocks, length, first = chunk.blocks[skipped:], chunk.length - skipped * k_cache.shape[1], chunk.first_key % k_cache.shape[1]
        k = _sequence_kv(k_cache, blocks, length)[first:].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
        v = _sequence_kv(v_cache, blocks, length)[first:].transpose(0, 1).unsqueeze(0)
        queries = q[chunk.start : chunk.end].transpose(0, 1).unsqueeze(0)  # [1, H, n, D]
        if chunk.mask is None:  # no cached prefix: the plain causal kernel
            attended = F.scaled_dot_product_attention(queries, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            attended = F.scaled_dot_product_attention(queries, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[chunk.start : chunk.end] = attended[0].transpose(0, 1)
    return out


def _sequence_kv(cache: torch.Tensor, blocks: torch.Tensor, length: int) -> torch.Tensor:
    return cache.index_select(0, blocks).flatten(0, 1)[:length]  # [length, KVH, D]


def attend_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, mask: torch.Tensor | None):
    """q [B, KVH, R, D] (R query rows per kv head), k/v [B, KVH, L, D], mask [B, 1, 1, L]
    -> (out [B, KVH, R, D] fp32, lse [B, KVH, R] natural log; -inf for rows with no keys)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale  # [B, KVH, R, L]
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse.clamp_min(torch.finfo(torch.float32).min).unsqueeze(-1))
    return torch.matmul(probs, v.float()), lse


@dataclass(frozen=True)
class JoinedKeys:
    """A group's prefix and its members' suffixes as one key sequence, for one masked SDPA call."""

    blocks: torch.Tensor  # the prefix's blocks, then each member's suffix blocks (same count each)
    mask: torch.Tensor  # [1, 1, count * query_group, len(blocks) * block_size]: the keys each query row sees


@dataclass(frozen=True)
class PrefixGroupPlan:
    """Decodes that share one prefix (``length`` 0: those that share none)."""

    rows: torch.Tensor  # their rows in the batch
    count: int
    length: int
    blocks: torch.Tensor  # the prefix's blocks
    joined: JoinedKeys | None = None  # set when the group goes through one masked SDPA call


@dataclass(frozen=True)
class SharedPrefixPlan:
    suffix: PaddedGather
    groups: list[PrefixGroupPlan]

    @property
    def needs_suffix_scores(self) -> bool:
        return any(group.joined is None for group in self.groups)


def plan_shared_prefix(prefix_ids, prefix_block_tables, prefix_lens, suffix_block_tables, suffix_lens,
                       block_size: int, *, query_group: int) -> SharedPrefixPlan:
    """``query_group``: query heads per kv head."""
    members: dict[int, list[int]] = {}
    for row, prefix in enumerate(prefix_ids.tolist()):
        members.setdefault(prefix, []).append(row)
    prefix_lengths, own_lengths = prefix_lens.tolist(), suffix_lens.tolist()
    groups = []
    for prefix, rows in members.items():
        length = prefix_lengths[prefix] if prefix >= 0 else 0
        blocks = prefix_block_tables[prefix, : -(-length // block_size)] if length else prefix_block_tables[:0, 0]
        own = [own_lengths[row] for row in rows]
        joined = None
        # One masked call beats a prefix pass + a suffix pass + their softmax while the members'
        # suffixes (each padded to the longest) add at most the prefix's length of masked keys.
        if length and len(rows) * max(own) <= length and min(own) > 0:
            joined = join_keys(blocks, suffix_block_tables[rows], length, own, block_size, query_group)
        groups.append(PrefixGroupPlan(torch.tensor(rows), len(rows), length, blocks, joined))
    return SharedPrefixPlan(plan_decode(suffix_block_tables, suffix_lens, block_size), groups)


def join_keys(prefix_blocks, member_tables, length: int, own: list[int], block_size: int, query_group: int) -> JoinedKeys:
    own_blocks = -(-max(own) // block_size)
    blocks = torch.cat([prefix_blocks, member_tables[:, :own_blocks].clamp(min=0).flatten()])
    prefix_span, own_span = len(prefix_blocks) * block_size, own_blocks * block_size
    visible = torch.zeros(len(own), blocks.numel() * block_size, dtype=torch.bool)
    visible[:, :length] = True
    for member, n in enumerate(own):
        start = prefix_span + member * own_span
        visible[member, start : start + n] = True
    mask = visible.repeat_interleave(query_group, 0)[None, None]  # query row = member * query_group + head
    return JoinedKeys(blocks, mask)


def shared_prefix_decode(
    q, k_cache, v_cache, prefix_ids, prefix_block_tables, prefix_lens, suffix_block_tables, suffix_lens, scale,
    *, out=None, plan: SharedPrefixPlan | None = None,
):
    """Each prefix's KV gathered once and scored by all its sequences together. A group whose
    members' suffixes are short next to its prefix goes through one masked SDPA call over the
    prefix and all their suffixes (torch's fused kernel, in the cache's dtype; faster than the two
    passes below, most for few sequences: `python -m benchmarks.kernels --cpu`, its shared-prefix rows).
    Otherwise a row's prefix and suffix scores go through one softmax together, so there
    is nothing to merge afterwards (as fast here as two log-sum-exp passes and a merge)."""
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    plan = plan or plan_shared_prefix(prefix_ids, prefix_block_tables, prefix_lens, suffix_block_tables,
                                      suffix_lens, k_cache.shape[1], query_group=group)
    grouped_q = q.view(batch, num_kv_heads, group, head_dim)
    attended = torch.empty(batch, num_kv_heads, group, head_dim, dtype=q.dtype)
    if plan.needs_suffix_scores:
        k = gather(k_cache, plan.suffix).float()  # [B, KVH, Ls, D]
        v = gather(v_cache, plan.suffix).float()
        suffix_scores = torch.matmul(grouped_q.float(), k.transpose(-1, -2)) * scale  # [B, KVH, G, Ls]
        if plan.suffix.mask is not None:
            suffix_scores.masked_fill_(~plan.suffix.mask, float("-inf"))
    for members in plan.groups:
        index = members.rows
        if members.joined is not None:
            attended[index] = _attend_joined(grouped_q[index], k_cache, v_cache, members.joined, scale)
        elif members.length == 0:
            attended[index] = torch.matmul(torch.softmax(suffix_scores[index], -1), v[index]).to(q.dtype)
        else:
            attended[index] = _attend_prefix_then_suffix(
                grouped_q[index].float(), suffix_scores[index], v[index], k_cache, v_cache, members, scale).to(q.dtype)
    if plan.suffix.any_empty:
        attended = attended.nan_to_num(0.0)  # rows with no keys at all: softmax of all -inf
    merged = attended.reshape(batch, num_heads, head_dim)
    return merged if out is None else out.copy_(merged)


def _attend_joined(queries, k_cache, v_cache, joined: JoinedKeys, scale):
    """queries [n, KVH, G, D] -> [n, KVH, G, D]: one SDPA call, kv heads as its heads."""
    n, num_kv_heads, group, head_dim = queries.shape
    k = k_cache.index_select(0, joined.blocks).flatten(0, 1).transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
    v = v_cache.index_select(0, joined.blocks).flatten(0, 1).transpose(0, 1).unsqueeze(0)
    rows = queries.transpose(0, 1).reshape(1, num_kv_heads, n * group, head_dim)
    attended = F.scaled_dot_product_attention(rows, k, v, attn_mask=joined.mask, scale=scale)
    return attended.view(num_kv_heads, n, group, head_dim).transpose(0, 1)


def _attend_prefix_then_suffix(queries, suffix_scores, v, k_cache, v_cache, members: PrefixGroupPlan, scale):
    """queries [n, KVH, G, D] fp32, suffix_scores [n, KVH, G, Ls], v [n, KVH, Ls, D] -> [n, KVH, G, D] fp32."""
    n, num_kv_heads, group, head_dim = queries.shape
    length, max_suffix = members.length, suffix_scores.shape[-1]
    pk = _sequence_kv(k_cache, members.blocks, length).transpose(0, 1).float()  # [KVH, Lp, D]
    pv = _sequence_kv(v_cache, members.blocks, length).transpose(0, 1).float()
    rows = queries.transpose(0, 1).reshape(num_kv_heads, n * group, head_dim)
    prefix_scores = torch.matmul(rows, pk.transpose(-1, -2)) * scale  # [KVH, n*G, Lp]
    own_scores = suffix_scores.transpose(0, 1).reshape(num_kv_heads, n * group, max_suffix)
    probs = torch.softmax(torch.cat([prefix_scores, own_scores], -1), -1)  # [KVH, n*G, Lp + Ls]
    from_prefix = torch.matmul(probs[..., :length], pv).view(num_kv_heads, n, group, head_dim).transpose(0, 1)
    own_probs = probs[..., length:].reshape(num_kv_heads, n, group, max_suffix).transpose(0, 1)
    return from_prefix + torch.matmul(own_probs, v)


def kv_write(key, value, k_cache, v_cache, slot_mapping):
    """In place; slot -1 skipped. index_copy_ is several times cheaper than an indexed store."""
    slots = slot_mapping.long()
    if bool((slots < 0).any()):
        keep = slots >= 0
        key, value, slots = key[keep], value[keep], slots[keep]
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, key.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, value.to(v_cache.dtype))
