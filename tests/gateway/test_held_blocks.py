"""What an engine holds, as its KV events say (gateway/held_blocks.py): the builtin engine's block manager records
its prefix cache's changes as vLLM's events (engines/builtin/block_manager.py), and the gateway's view built from
them matches what the cache holds, through stores, evictions and a failed step; vLLM's captured events
(tests/fixtures/vllm_0.32.0_kv_events.msgpack) read the same way."""

from __future__ import annotations

import msgspec

from engines.builtin.block_manager import BlockManager
from engines.builtin.context import Context
from engines.seam.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from gateway.held_blocks import HeldBlocks, chain_hashes
from tests.engines.seam.test_vllm_kv_events_format import FIXTURE

SIZE = 4


def computed(manager: BlockManager, tokens: list[int], name: str) -> Context:
    ctx = Context(name, tokens)
    manager.match_prefix(ctx, len(ctx))
    manager.allocate(ctx, ctx.num_pending_tokens)
    manager.commit()
    ctx.num_computed_tokens = len(tokens)
    return ctx


def cached_prefixes(manager: BlockManager, prompts: list[list[int]]) -> list[int]:
    """Per prompt, the tokens of it the engine's cache would serve (a fresh context's match, not kept)."""
    served = []
    for tokens in prompts:
        probe = Context("probe", tokens)
        served.append(manager.match_prefix(probe, len(tokens)))
        manager.release(probe)
    return served


def test_the_view_built_from_the_events_is_what_the_cache_holds():
    manager = BlockManager(10, SIZE)
    manager.events = []
    view = HeldBlocks()
    a, b, c = list(range(12)), list(range(8)) + [50, 51, 52, 53, 54], [90 + i for i in range(14)]
    prompts = [a, b, c, a[:6], b + [60, 61, 62]]

    def check() -> None:
        view.apply(manager.events)
        manager.events.clear()
        assert [view.held_tokens(p) for p in prompts] == cached_prefixes(manager, prompts)

    first = computed(manager, a, "a")
    check()
    assert view.held_tokens(a) == 12 and view.block_size == SIZE
    second = computed(manager, b, "b")  # shares a's first two blocks: only its own third is stored
    check()
    manager.release(first)
    manager.release(second)
    computed(manager, c, "c")  # 4 blocks wanted, 6 free of which 4 cached: a's and b's oldest evicted
    check()
    assert view.held_tokens(c) == 12
    ctx = Context("d", [7] * 9)
    manager.allocate(ctx, 9)  # a step that then failed: its published blocks are taken back
    manager.rollback()
    check()


def test_a_stored_event_says_block_size_tokens_per_hash_and_chains_to_its_parent():
    manager = BlockManager(8, SIZE)
    manager.events = []
    computed(manager, list(range(8)), "a")
    computed(manager, list(range(8)) + [9, 9, 9, 9], "b")
    first, second = manager.events
    assert isinstance(first, BlockStored) and first.parent_block_hash is None and len(first.block_hashes) == 2
    assert first.token_ids == list(range(8)) and first.block_size == SIZE and first.medium == "GPU"
    assert second.parent_block_hash == first.block_hashes[-1] and second.token_ids == [9, 9, 9, 9]
    assert all(0 <= h < 2**64 for h in first.block_hashes + second.block_hashes)  # as vLLM's: uint64
    wire = msgspec.msgpack.decode(msgspec.msgpack.encode(first))
    assert list(wire)[:8] == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id",
                              "medium", "lora_name"]  # vLLM's field order (docs/kv-events.md)


def test_a_block_whose_parent_was_missed_or_with_extra_keys_is_not_matched():
    view = HeldBlocks()
    tokens = list(range(8))
    view.apply([BlockStored([11], 99, tokens[:4], 4, None, "GPU", None)])  # parent 99 never stored
    assert len(view) == 0
    view.apply([BlockStored([11, 12], None, tokens, 4, None, "GPU", None, extra_keys=[["salt"], ["salt"]])])
    assert view.held_tokens(tokens) == 0  # a salted block is not a plain prompt's
    view.apply([BlockStored([21, 22], None, tokens, 4, None, "GPU", None)])
    assert view.held_tokens(tokens) == 8
    view.apply([BlockStored([31], None, [5, 5, 5, 5], 4, None, "CPU", None)])  # offloaded: not a hit at prefill
    assert view.held_tokens([5, 5, 5, 5]) == 0
    removed = []
    view.on_removed(removed.append)
    view.apply([BlockRemoved([22], "GPU")])
    assert view.held_tokens(tokens) == 4 and removed == [{chain_hashes(tokens, 4)[1]}]
    view.apply([AllBlocksCleared()])
    assert len(view) == 0 and view.held_tokens(tokens) == 0


def test_vllms_captured_events_build_a_view_of_its_prompts_blocks():
    frames = msgspec.msgpack.decode(FIXTURE.read_bytes())
    stored, evicting, cleared = (decode_batch(payload) for _, _, payload in frames)
    view = HeldBlocks()
    view.apply(stored.events)
    [prompt] = stored.events
    assert view.block_size == 128 and view.held_tokens(prompt.token_ids) == 896  # its 7 full blocks
    view.apply(evicting.events)
    assert view.held_tokens(prompt.token_ids) == 3 * 128  # its last four evicted, last block first
    view.apply(cleared.events)
    assert len(view) == 0


def test_a_block_whose_parent_was_missed_is_placed_by_a_prompt_sent_there():
    """A consumer that joined late never sees a hot prefix stored (it was stored once, and hit since): the blocks
    stored after it are placed by the prompt the gateway sent, and the prefix before them is then known held."""
    view = HeldBlocks()
    tokens = list(range(16))
    view.placed(tokens)
    view.apply([BlockStored([11, 12], 99, tokens[8:16], 4, None, "GPU", None)])  # parent 99: blocks 0-1, never seen
    assert view.held_tokens(tokens) == 16 and view.held_tokens(tokens[:8] + [0, 0, 0, 0]) == 8
    view.apply([BlockRemoved([99], "GPU")])  # the parent evicted: what was known through it goes too
    assert view.held_tokens(tokens) == 0
    view.apply([BlockStored([21], 98, [7, 7, 7, 7], 4, None, "GPU", None)])  # in no prompt sent there
    assert view.held_tokens([0, 1, 2, 3, 7, 7, 7, 7]) == 0
