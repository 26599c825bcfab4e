"""KV-cache events as vLLM publishes them (vllm 0.32.0, ``vllm/distributed/kv_events.py``; docs/kv-events.md): the
one schema of the builtin engine's publisher (engines/builtin/kv_event_publisher.py) and the gateway's consumer
(gateway/kv_events.py).

A message is three ZMQ frames, ``(topic, seq, payload)``: the topic in UTF-8, the sequence number as 8 bytes
big-endian counting from 0 per publisher, and one msgpack ``KVEventBatch``. The Structs encode as vLLM's do
(``omit_defaults``; events tagged by class name, a batch array-like), so a consumer of either reads both.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

# Hashes are uint64 (vLLM's default, VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1) or 32 raw bytes (with it set to 0).
BlockHash = Union[int, bytes]
UINT64 = 2**64 - 1
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # a replay's end marker, in the sequence frame


class BlockStored(msgspec.Struct, tag=True, omit_defaults=True):
    """Full blocks entered the prefix cache: ``token_ids`` holds ``block_size`` tokens per hash, in order; the
    first block's parent is ``parent_block_hash`` (None: the prompt's first block)."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None  # per block: the LoRA name, multimodal ids, cache salt (None: nothing)
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(msgspec.Struct, tag=True, omit_defaults=True):
    block_hashes: list[BlockHash]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class AllBlocksCleared(msgspec.Struct, tag=True, omit_defaults=True):
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True):
    ts: float
    events: list[KVEvent]
    data_parallel_rank: int | None = None


_decoder = msgspec.msgpack.Decoder(KVEventBatch)
_encoder = msgspec.msgpack.Encoder()


def decode_batch(payload: bytes) -> KVEventBatch:
    """One message's payload; raises msgspec.DecodeError (a ValueError) on anything else."""
    return _decoder.decode(payload)


def encode_batch(batch: KVEventBatch) -> bytes:
    return _encoder.encode(batch)


def binds(endpoint: str) -> bool:
    """vLLM's rule for its publisher, and the subscriber's mirror of it: an endpoint with a wildcard, or a local
    transport (ipc://, inproc://), is bound; any other address is connected to (the other side binds it)."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


def seq_frame(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def seq_of(frame: bytes) -> int:
    """A sequence frame's number; -1 for the replay's end marker."""
    return int.from_bytes(frame, "big", signed=True)
