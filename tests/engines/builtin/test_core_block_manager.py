"""Block manager: reference counts, prefix-cache hits (same-step ones too, and a fork's own tokens),
copy-on-write fork, LRU eviction, a failed step's blocks unpublished."""

from __future__ import annotations

from engines.builtin.block_manager import BlockManager
from engines.builtin.context import Context, Status

SIZE = 4


def computed(manager: BlockManager, tokens: list[int], name: str = "s") -> Context:
    """A sequence whose tokens all got blocks and were computed, as after a prefill step."""
    ctx = Context(name, tokens)
    scheduled(manager, ctx)
    manager.commit()
    ctx.num_computed_tokens = len(tokens)
    return ctx


def scheduled(manager: BlockManager, ctx: Context) -> int:
    """Admits ``ctx`` into a step as the scheduler does; returns the tokens it computes there."""
    manager.match_prefix(ctx, len(ctx))
    pending = ctx.num_pending_tokens
    manager.allocate(ctx, pending)
    return pending


def test_allocate_and_release_count_references():
    manager = BlockManager(8, SIZE)
    ctx = computed(manager, list(range(10)))  # 2 full blocks + 2 tokens
    assert len(ctx.block_table) == 3 and manager.num_free_blocks == 5
    assert all(manager.blocks[b].ref_count == 1 for b in ctx.block_table)
    assert manager.release(ctx) == 3
    assert manager.num_free_blocks == 8 and ctx.block_table == [] and ctx.num_computed_tokens == 0


def test_prefix_hit_shares_full_blocks_only():
    manager = BlockManager(8, SIZE)
    first = computed(manager, list(range(10)))
    second = Context("b", list(range(8)) + [99, 98, 97])
    assert manager.match_prefix(second, len(second)) == 8
    assert second.block_table == first.block_table[:2]
    assert [manager.blocks[b].ref_count for b in first.block_table] == [2, 2, 1]
    assert manager.num_cached_tokens == 8  # the partial third block is not published
    assert manager.prefix_hit_tokens == 8


def test_prefix_hit_requires_the_same_prefix_and_respects_the_limit():
    manager = BlockManager(8, SIZE)
    computed(manager, list(range(8)))
    other_start = Context("c", [7, 7, 7, 7] + list(range(4, 8)))
    assert manager.match_prefix(other_start, 8) == 0  # same second block, different chain
    limited = Context("d", list(range(8)))
    assert manager.match_prefix(limited, 7) == 4  # a generation keeps its last token to compute


def test_released_blocks_stay_cached_until_reused_oldest_first():
    manager = BlockManager(4, SIZE)
    old = computed(manager, list(range(8)), "old")
    manager.release(old)
    recent = computed(manager, list(range(100, 108)), "recent")
    manager.release(recent)
    assert manager.num_free_blocks == 4 and manager.num_cached_tokens == 16
    # Two fresh blocks evict the least recently freed: old's, tail first.
    computed(manager, list(range(200, 208)), "new")
    assert manager.match_prefix(Context("x", list(range(8))), 8) == 0
    assert manager.match_prefix(Context("y", list(range(100, 108))), 8) == 8


def test_cached_block_in_use_is_not_evicted():
    manager = BlockManager(3, SIZE)
    keeper = computed(manager, list(range(4)), "keeper")
    manager.release(keeper)
    user = Context("user", list(range(4)))
    assert manager.match_prefix(user, 4) == 4  # takes the block back off the free list
    assert manager.num_free_blocks == 2
    computed(manager, list(range(50, 58)), "filler")
    assert manager.num_free_blocks == 0 and user.block_table == keeper_block(manager)


def keeper_block(manager: BlockManager) -> list[int]:
    return [b.block_id for b in manager.blocks if b.token_ids == (0, 1, 2, 3)]


def test_fork_shares_full_blocks_and_copies_the_partial_one():
    copies = []
    manager = BlockManager(8, SIZE, copy_rows=lambda src, dst, n: copies.append((src, dst, n)))
    parent = computed(manager, list(range(10)))
    child = Context("child", parent.token_ids)
    manager.fork(parent, child)
    assert child.block_table[:2] == parent.block_table[:2]
    assert child.block_table[2] != parent.block_table[2]
    assert copies == [(parent.block_table[2], child.block_table[2], 2)]
    assert child.num_computed_tokens == 10
    assert [manager.blocks[b].ref_count for b in parent.block_table] == [2, 2, 1]
    # Freeing the parent leaves the child's KV alive.
    manager.release(parent)
    assert all(manager.blocks[b].ref_count == 1 for b in child.block_table)
    assert manager.num_free_blocks == 8 - 3


def test_a_fork_of_an_idle_parent_with_a_pending_last_token_copies_its_computed_rows():
    """A finished generation's context holds its last token uncomputed (never fed back): a fork of it copies the
    computed rows of its partial block and computes the rest, rather than recomputing the block; a fork of a parent
    still filling starts at its last full block (it matches the parent's next blocks as they are scheduled)."""
    copies = []
    manager = BlockManager(8, SIZE, copy_rows=lambda src, dst, n: copies.append((src, dst, n)))
    parent = computed(manager, list(range(10)))
    parent.token_ids.append(10)  # generated, not computed
    child = Context("child", parent.token_ids)
    manager.fork(parent, child)
    assert copies == [(parent.block_table[2], child.block_table[2], 2)]
    assert child.num_computed_tokens == 10 and child.num_pending_tokens == 1
    parent.status = Status.WAITING  # a fill queued on it
    filling_child = Context("filling", parent.token_ids)
    manager.fork(parent, filling_child)
    assert filling_child.block_table == parent.block_table[:2] and filling_child.num_computed_tokens == 8
    assert len(copies) == 1


def test_a_forks_own_tokens_find_cached_blocks_past_the_copied_rows():
    manager = BlockManager(8, SIZE)
    earlier = computed(manager, list(range(14)), "earlier")  # publishes blocks 0-3, 4-7, 8-11
    parent = computed(manager, list(range(10)), "parent")  # its third block: 2 rows, private
    child = Context("child", parent.token_ids)
    manager.fork(parent, child)
    copy = child.block_table[2]
    child.token_ids += [10, 11, 12, 13, 99]
    # The cached block holding rows 8-11 replaces the copy (2 tokens gained), and no more: 12-15 is not cached.
    assert manager.match_prefix(child, len(child) - 1) == 2
    assert child.block_table == earlier.block_table[:3] and child.num_computed_tokens == 12
    assert manager.blocks[copy].ref_count == 0 and next(iter(manager.free)) == copy  # the copy is reused first
    assert scheduled(manager, child) == 3  # 12, 13 and 99


def test_a_forks_copied_rows_stay_when_no_cached_block_holds_its_next_tokens():
    manager = BlockManager(8, SIZE)
    computed(manager, list(range(12)), "earlier")
    parent = computed(manager, list(range(10)), "parent")
    child = Context("child", parent.token_ids)
    manager.fork(parent, child)
    table = list(child.block_table)
    child.token_ids += [77, 11]  # rows 8-11 differ from the cached block's
    assert manager.match_prefix(child, len(child)) == 0
    assert child.block_table == table and child.num_computed_tokens == 10
    short = Context("short", parent.token_ids)
    manager.fork(parent, short)
    short.token_ids += [10, 11]
    assert manager.match_prefix(short, 1) == 0  # the block would bring 2 tokens, more than allowed


def test_uncompute_last_token_copies_a_shared_block():
    copies = []
    manager = BlockManager(8, SIZE, copy_rows=lambda src, dst, n: copies.append((src, dst, n)))
    parent = computed(manager, list(range(8)))
    child = Context("child", parent.token_ids)
    manager.fork(parent, child)
    manager.uncompute_last_token(child)
    assert child.num_computed_tokens == 7
    assert child.block_table[0] == parent.block_table[0] and child.block_table[1] != parent.block_table[1]
    assert copies == [(parent.block_table[1], child.block_table[1], 3)]
    assert manager.blocks[parent.block_table[1]].ref_count == 1


def test_blocks_scheduled_this_step_are_shared_by_a_later_admission_in_it():
    manager = BlockManager(8, SIZE)
    first, second = Context("a", list(range(10))), Context("b", list(range(8)) + [99])
    assert scheduled(manager, first) == 10
    assert scheduled(manager, second) == 1  # its two full blocks are being computed by the first
    assert second.block_table[:2] == first.block_table[:2]
    manager.commit()
    assert manager.num_cached_tokens == 8


def test_a_failed_step_unpublishes_its_blocks_and_keeps_earlier_ones():
    manager = BlockManager(8, SIZE)
    earlier = computed(manager, list(range(4)))
    ctx = Context("b", list(range(12)))
    assert scheduled(manager, ctx) == 8
    assert manager.rollback() == set(ctx.block_table[1:])
    assert manager.num_cached_tokens == 4
    assert manager.match_prefix(Context("c", list(range(12))), 12) == 4
    assert all(manager.blocks[b].hash is None for b in ctx.block_table[1:])
    assert earlier.block_table[0] == ctx.block_table[0]


def test_truncate_keeps_the_first_tokens_kv_and_copies_a_last_block_others_may_find():
    copies = []
    manager = BlockManager(8, SIZE, copy_rows=lambda src, dst, n: copies.append((src, dst, n)))
    ctx = computed(manager, list(range(14)))  # 0-3, 4-7, 8-11 published; 12-13 private
    table = list(ctx.block_table)
    del ctx.token_ids[6:]
    manager.truncate(ctx, 6)
    # Block 4-7 is in the prefix cache: rows 6-7 will hold other tokens, so its first two rows are copied.
    assert ctx.num_computed_tokens == 6 and ctx.block_table[0] == table[0] and ctx.block_table[1] not in table
    assert copies == [(table[1], ctx.block_table[1], 2)]
    assert [manager.blocks[b].ref_count for b in table] == [1, 0, 0, 0]
    assert manager.match_prefix(Context("other", list(range(13))), 12) == 12  # the dropped blocks stay cached


def test_truncate_inside_a_private_block_keeps_it_and_past_the_computed_tokens_keeps_all():
    manager = BlockManager(8, SIZE)
    ctx = computed(manager, list(range(14)))
    table = list(ctx.block_table)
    del ctx.token_ids[13:]
    manager.truncate(ctx, 13)  # 12-13 was nobody else's: written over in place later
    assert ctx.block_table == table and ctx.num_computed_tokens == 13
    ctx.token_ids.append(99)  # a generated last token, its KV not computed yet
    manager.truncate(ctx, 14)
    assert ctx.block_table == table and ctx.num_computed_tokens == 13
