"""The gateway's consumer of an engine's KV events (gateway/kv_events.py) on real ZMQ sockets in this process: messages
applied in sequence order; a gap replayed from the publisher's replay socket (the builtin engine's publisher,
engines/builtin/kv_event_publisher.py, which follows vLLM's), or, without one, what is known reset; everything
cleared on AllBlocksCleared; the stream taken as silent when work that should store blocks gets no event."""

from __future__ import annotations

import asyncio
import socket

import zmq

from engines.builtin.kv_event_publisher import KVEventPublisher
from engines.seam.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, encode_batch, seq_frame
from gateway.kv_events import KVEventStream
from tests.support.waiting import eventually

TOKENS = list(range(32))


def port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stored(hashes: list[int], parent: int | None, tokens: list[int]) -> BlockStored:
    return BlockStored(hashes, parent, tokens, 4, None, "GPU", None)


def message(seq: int, *events) -> list[bytes]:
    return [b"kv", seq_frame(seq), encode_batch(KVEventBatch(1.0, list(events), 0))]


async def test_messages_in_order_then_a_gap_without_replay_resets_what_is_known():
    pub = zmq.Context.instance().socket(zmq.PUB)  # sending as the engine's thread does
    address = f"tcp://127.0.0.1:{port()}"
    pub.bind(address)
    stream = KVEventStream("e", address, topic="kv")
    stream.start()
    try:
        assert not stream.live()  # nothing heard yet: the scheduler keeps its mirror
        first = message(0, stored([1, 2], None, TOKENS[:8]))
        await eventually(lambda: pub.send_multipart(first) is None and stream.messages == 1)  # a SUB joins late
        assert stream.live() and stream.blocks.held_tokens(TOKENS) == 8
        pub.send_multipart(message(1, stored([3], 2, TOKENS[8:12]), BlockRemoved([2], "GPU")))
        await eventually(lambda: stream.messages == 2)
        assert stream.blocks.held_tokens(TOKENS) == 4  # its second block removed
        pub.send_multipart(message(3, stored([7], None, [9, 9, 9, 9])))  # message 2 lost
        await eventually(lambda: stream.messages == 3)
        assert (stream.gaps, stream.resets, stream.next_seq) == (1, 1, 4)
        assert stream.blocks.held_tokens(TOKENS) == 0 and stream.blocks.held_tokens([9, 9, 9, 9]) == 4
        pub.send_multipart(message(4, AllBlocksCleared()))
        await eventually(lambda: stream.messages == 4)
        assert len(stream.blocks) == 0 and stream.live()
    finally:
        await stream.aclose()
        pub.close(linger=0)


async def test_a_subscriber_that_joined_late_is_replayed_what_it_missed():
    address, replay = f"tcp://*:{port()}", f"tcp://127.0.0.1:{port()}"
    publisher = KVEventPublisher(address, replay_endpoint=replay, topic="kv-events")
    stream = KVEventStream("e", address.replace("*", "127.0.0.1"), replay_endpoint=replay, topic="kv-events")
    try:
        publisher.publish([stored([1, 2], None, TOKENS[:8])])  # before anyone listens: lost on the PUB socket
        publisher.publish([stored([3], 2, TOKENS[8:12])])
        await eventually(lambda: publisher.sent == 2)  # gone out before anyone subscribed
        stream.start()
        extra = 0
        while stream.messages == 0:  # until the SUB socket is connected, messages are dropped
            publisher.publish([stored([100 + extra], None, [extra] * 4)])
            extra += 1
            await asyncio.sleep(0.05)
        await eventually(lambda: stream.next_seq == 2 + extra)
        assert stream.gaps == 1 and stream.replayed >= 2 and stream.resets == 0
        assert stream.blocks.held_tokens(TOKENS) == 12  # the first two messages, replayed
    finally:
        await stream.aclose()
        publisher.shutdown()


async def test_work_that_should_store_blocks_and_gets_no_event_makes_the_stream_silent():
    pub = zmq.Context.instance().socket(zmq.PUB)  # sending as the engine's thread does
    address = f"tcp://127.0.0.1:{port()}"
    pub.bind(address)
    stream = KVEventStream("e", address, silence_s=0.2)
    stream.start()
    try:
        first = message(0, stored([1], None, TOKENS[:4]))
        first[0] = b""
        await eventually(lambda: pub.send_multipart(first) is None and stream.messages == 1)
        stream.expect()
        assert stream.live()
        await eventually(lambda: not stream.live(), timeout_s=2)
        second = message(1, stored([2], 1, TOKENS[4:8]))
        second[0] = b""
        pub.send_multipart(second)
        await eventually(stream.live)  # an event came: believed again
    finally:
        await stream.aclose()
        pub.close(linger=0)
