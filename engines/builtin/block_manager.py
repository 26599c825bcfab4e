"""Fixed-size KV blocks with reference counts, a prefix cache and fork with copy-on-write.

A full block gets a chain hash, ``hash((previous block's hash, tokens))``, so one hash names a
whole prefix; a lookup is confirmed by comparing the block's tokens. A block is published when
it is scheduled to become full, not after: a sequence admitted later in the same step then
shares it instead of computing the same prefix beside it (each layer writes the step's keys and
values before any of its attention reads them). ``commit`` marks the step's blocks computed;
``rollback`` unpublishes them when the step failed. Blocks whose last reference goes away stay
in the cache (their KV is intact) on an LRU free list and are reused for new data oldest first.
Partial blocks are never shared: ``fork`` shares the parent's fully computed blocks and copies
the rows of the rest into a fresh block (unless the parent is still filling: then the child
matches its next blocks); the child's own tokens then find cached blocks as any sequence's do, the
first one (holding the copied rows) taking the copy's place. With ``prefix_caching`` off, blocks are
never published or looked up; forks still share explicitly. With ``events`` a list, the cache's changes are
recorded there as vLLM's KV events (blocks stored, blocks removed; engines/seam/kv_events.py), for the step loop
to publish (kv_event_publisher.py).

Where every layer of the model has a sliding window (Mistral, Phi-3), a sequence's blocks that lie wholly before
what its next token's window can see are freed as it moves on (``free_outside_window``): its table keeps
``FREED`` in their place, which no kernel reads (the windowed layers' tables start at the window's block,
attention.py). One table serves all layers, so a model with some global layers (Gemma 2 and 3 alternate them)
frees nothing: per-layer-group tables would, at the cost of a pool, a prefix cache and forks per group.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable

from engines.builtin.context import Context, Status
from engines.seam.kv_events import UINT64, BlockRemoved, BlockStored, KVEvent

NO_HASH = None
FREED = -1  # a block-table entry whose block a sliding window let go: nothing before the window reads it


class Block:
    __slots__ = ("block_id", "ref_count", "hash", "token_ids")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_count = 0
        self.hash: int | None = NO_HASH
        self.token_ids: tuple[int, ...] = ()


def chain_hash(previous: int | None, token_ids: tuple[int, ...]) -> int:
    return hash((previous, token_ids))


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        copy_rows: Callable[[int, int, int], None] | None = None,
        *,
        prefix_caching: bool = True,
        window: int | None = None,
    ):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # Every layer's sliding window, the widest (model.Architecture.freeing_window): keys further back than it
        # from a sequence's next token are seen by no layer. None: some layer sees the whole context.
        self.window = window
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.cached: dict[int, int] = {}  # chain hash -> block id
        self.free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))  # oldest first
        # copy_rows(src_block, dst_block, num_rows): copies KV rows, set by the model runner.
        self.copy_rows = copy_rows or (lambda src, dst, n: None)
        self.prefix_hit_tokens = 0  # tokens served from cache or parent instead of computed
        self._in_flight: list[int] = []  # blocks published this step, computed once it ran
        self.events: list[KVEvent] | None = None  # a list: the prefix cache's changes recorded there

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_cached_tokens(self) -> int:
        return len(self.cached) * self.block_size

    def blocks_needed(self, ctx: Context, num_new_tokens: int) -> int:
        """Blocks to add so that the next ``num_new_tokens`` uncomputed tokens have slots."""
        needed_slots = ctx.num_computed_tokens + num_new_tokens
        return max(0, -(-needed_slots // self.block_size) - len(ctx.block_table))

    def can_allocate(self, ctx: Context, num_new_tokens: int) -> bool:
        return self.blocks_needed(ctx, num_new_tokens) <= self.num_free_blocks

    def allocate(self, ctx: Context, num_new_tokens: int) -> None:
        """Slots for the next ``num_new_tokens`` tokens, which this step computes."""
        for _ in range(self.blocks_needed(ctx, num_new_tokens)):
            ctx.block_table.append(self._take_free_block().block_id)
        self._publish(ctx, ctx.num_computed_tokens + num_new_tokens)

    def match_prefix(self, ctx: Context, max_tokens: int) -> int:
        """Extends ``ctx`` with cached blocks holding its next full blocks; returns tokens reused.

        With nothing allocated past the computed tokens, from a block boundary or from a fork's copy of
        its parent's partial block (``_match_partial``), and at most ``max_tokens`` (a generation must
        still compute its last prompt token to get logits).
        """
        size = self.block_size
        start = ctx.num_computed_tokens
        if not self.prefix_caching or len(ctx.block_table) != -(-start // size):
            return 0
        reused = 0
        if start % size:
            reused = self._match_partial(ctx, max_tokens)
            if not reused:
                return 0
        previous = self._hash_at(ctx, len(ctx.block_table) - 1) if ctx.block_table else None
        while start + reused + size <= min(len(ctx), start + max_tokens):
            if ctx.block_table and previous is NO_HASH:
                break
            tokens = tuple(ctx.token_ids[start + reused : start + reused + size])
            block_id = self.cached.get(chain_hash(previous, tokens))
            if block_id is None or self.blocks[block_id].token_ids != tokens:
                break
            self._reference(block_id)
            ctx.block_table.append(block_id)
            previous = self.blocks[block_id].hash
            reused += size
        ctx.num_computed_tokens += reused
        self.prefix_hit_tokens += reused
        return reused

    def _match_partial(self, ctx: Context, max_tokens: int) -> int:
        """A cached block holding ``ctx``'s partial last block and the tokens after it, put in place of it
        (a fork's private copy of its parent's rows, freed); returns the tokens it adds, or 0. So a fork's
        own tokens find the prefix cache as a plain request's do (a parent's text rarely ends on a block
        boundary)."""
        size = self.block_size
        start = ctx.num_computed_tokens
        index, end = start // size, (start // size + 1) * size
        partial = self.blocks[ctx.block_table[-1]]
        previous = self._hash_at(ctx, index - 1) if index else None
        if (partial.ref_count != 1 or partial.hash is not NO_HASH or (index and previous is NO_HASH)
                or end > min(len(ctx), start + max_tokens)):
            return 0
        tokens = tuple(ctx.token_ids[index * size : end])
        block_id = self.cached.get(chain_hash(previous, tokens))
        if block_id is None or self.blocks[block_id].token_ids != tokens:
            return 0
        partial.ref_count = 0
        self.free[partial.block_id] = None
        self.free.move_to_end(partial.block_id, last=False)  # holds nothing anyone can find: reused first
        self._reference(block_id)
        ctx.block_table[-1] = block_id
        return end - start

    def _publish(self, ctx: Context, computed_after: int) -> None:
        """Publishes the blocks that are full once ``ctx`` has ``computed_after`` tokens computed."""
        if not self.prefix_caching:
            return
        size = self.block_size
        stored: list[Block] = []  # a run of blocks newly cached, announced as one event
        for index in range(ctx.num_computed_tokens // size, computed_after // size):
            block = self.blocks[ctx.block_table[index]]
            if block.hash is not NO_HASH:
                continue
            previous = self._hash_at(ctx, index - 1) if index else None
            if index and previous is NO_HASH:
                break  # a chain with a gap names no prefix (a block freed by a window is one)
            block.token_ids = tuple(ctx.token_ids[index * size : (index + 1) * size])
            block.hash = chain_hash(previous, block.token_ids)
            if block.hash not in self.cached:  # another block with this prefix stays the one found
                self.cached[block.hash] = block.block_id
                stored.append(block)
            else:
                self._stored(stored, ctx)
            self._in_flight.append(block.block_id)
        self._stored(stored, ctx)

    def _stored(self, run: list[Block], ctx: Context) -> None:
        """Records ``run`` (consecutive blocks of ``ctx``, newly cached) as one BlockStored, and empties it."""
        if self.events is None or not run:
            run.clear()
            return
        first = ctx.block_table.index(run[0].block_id)
        parent = self.blocks[ctx.block_table[first - 1]].hash if first else None
        self.events.append(BlockStored(
            [block.hash & UINT64 for block in run], None if parent is None else parent & UINT64,
            [token for block in run for token in block.token_ids], self.block_size, None, "GPU", None))
        run.clear()

    def _removed(self, block: Block) -> None:
        """``block`` leaves the prefix cache."""
        del self.cached[block.hash]
        if self.events is not None:
            self.events.append(BlockRemoved([block.hash & UINT64], "GPU"))

    def commit(self) -> None:
        """The step ran: the blocks published for it hold their KV."""
        self._in_flight.clear()

    def rollback(self) -> set[int]:
        """The step failed: the blocks published for it may hold anything, so nobody may match them.
        Returns their ids: whoever holds one must drop its KV."""
        untrusted = set(self._in_flight)
        for block_id in untrusted:
            block = self.blocks[block_id]
            if self.cached.get(block.hash) == block_id:
                self._removed(block)
            block.hash, block.token_ids = NO_HASH, ()
        self._in_flight.clear()
        return untrusted

    def fork(self, parent: Context, child: Context) -> None:
        """Gives ``child`` the parent's KV: full computed blocks shared, the remainder copied."""
        size = self.block_size
        num_full = parent.num_computed_tokens // size
        remainder = parent.num_computed_tokens % size
        if remainder and (not self.free or parent.status is not Status.IDLE):
            # No block to copy into: the child recomputes those few tokens. A parent still filling: the
            # child starts at a block boundary, so it matches the parent's next blocks as they are scheduled.
            # An idle parent's pending tokens (a finished generation's last token, never fed back) are the
            # child's to compute after the copied rows: copying saves recomputing up to a block's tokens.
            remainder = 0
        for block_id in parent.block_table[:num_full]:
            if block_id != FREED:  # the child's windows start later than the parent's: it never reads those
                self._reference(block_id)
            child.block_table.append(block_id)
        if remainder:
            block = self._take_free_block()
            self.copy_rows(parent.block_table[num_full], block.block_id, remainder)
            child.block_table.append(block.block_id)
        child.num_computed_tokens = num_full * size + remainder
        self.prefix_hit_tokens += child.num_computed_tokens

    def uncompute_last_token(self, ctx: Context) -> None:
        """Marks the last token's KV as not computed, so a generation gets its logits again.

        The token is rewritten in place, so a block other sequences share is copied first.
        """
        assert ctx.num_computed_tokens == len(ctx) > 0
        ctx.num_computed_tokens -= 1
        index, rows = divmod(ctx.num_computed_tokens, self.block_size)
        block_id = ctx.block_table[index]
        if self.blocks[block_id].ref_count == 1:
            return
        if not self.free:
            self.release(ctx)  # nowhere to copy to: recompute it all, helped by the prefix cache
            return
        copy = self._take_free_block()
        self.copy_rows(block_id, copy.block_id, rows)
        self.blocks[block_id].ref_count -= 1  # still shared by others, so never reaches zero here
        ctx.block_table[index] = copy.block_id

    def truncate(self, ctx: Context, length: int) -> None:
        """Keeps the KV of ``ctx``'s first ``length`` tokens, dropping its blocks after them. A last block kept in
        part is copied first when others share it or the prefix cache names it (the rows after ``length`` will be
        rewritten with other tokens), or dropped with its rows when there is no block to copy into."""
        size = self.block_size
        computed = min(ctx.num_computed_tokens, length)
        if FREED in ctx.block_table:  # a window freed some: recompute it all, helped by the prefix cache
            self.release(ctx)
            return
        kept = -(-computed // size)
        for block_id in reversed(ctx.block_table[kept:]):
            self._unreference(block_id)
        del ctx.block_table[kept:]
        rows = computed % size
        if rows:
            block = self.blocks[ctx.block_table[-1]]
            if block.ref_count > 1 or block.hash is not NO_HASH:
                if self.free:
                    copy = self._take_free_block()
                    self.copy_rows(block.block_id, copy.block_id, rows)
                    ctx.block_table[-1] = copy.block_id
                else:
                    computed -= rows
                    ctx.block_table.pop()
                self._unreference(block.block_id)
        ctx.num_computed_tokens = computed

    def release(self, ctx: Context) -> int:
        """Drops ``ctx``'s blocks (its KV is then recomputed if needed); returns blocks freed."""
        # Tail blocks go in first so that a prefix's head outlives its tail under LRU.
        freed = sum(self._unreference(block_id) for block_id in reversed(ctx.block_table) if block_id != FREED)
        ctx.block_table = []
        ctx.num_computed_tokens = 0
        return freed

    def free_outside_window(self, ctx: Context) -> int:
        """Frees ``ctx``'s blocks that no layer's window reaches any more (``window`` set: every layer has one);
        returns blocks freed. Its next token, at num_computed_tokens, sees the keys after num_computed_tokens -
        window, later tokens fewer; the block holding that boundary stays. Their KV stays in the prefix cache
        until reused, as a released block's does."""
        if self.window is None:
            return 0
        freed, index = 0, (ctx.num_computed_tokens - self.window) // self.block_size - 1
        while index >= 0 and ctx.block_table[index] != FREED:  # the ones before were freed at an earlier step
            freed += self._unreference(ctx.block_table[index])
            ctx.block_table[index] = FREED
            index -= 1
        return freed

    def _unreference(self, block_id: int) -> int:
        """Drops one reference to the block; 1 if that freed it."""
        block = self.blocks[block_id]
        block.ref_count -= 1
        if block.ref_count:
            return 0
        self.free[block_id] = None
        return 1

    def _hash_at(self, ctx: Context, index: int) -> int | None:
        """The chain hash of ctx's block at ``index`` (NO_HASH where a window freed it: a gap in the chain)."""
        block_id = ctx.block_table[index]
        return NO_HASH if block_id == FREED else self.blocks[block_id].hash

    def _reference(self, block_id: int) -> None:
        block = self.blocks[block_id]
        if block.ref_count == 0:
            del self.free[block_id]
        block.ref_count += 1

    def _take_free_block(self) -> Block:
        block_id, _ = self.free.popitem(last=False)
        block = self.blocks[block_id]
        if block.hash is not NO_HASH and self.cached.get(block.hash) == block_id:
            self._removed(block)  # evicted: its KV is about to be overwritten
        block.hash, block.token_ids = NO_HASH, ()
        block.ref_count = 1
        return block
