"""One engine's KV-cache events consumed (vLLM's, or the builtin engine's in the same schema: docs/kv-events.md):
a ZMQ SUB socket on its configured endpoint (``[[upstreams]] kv_events``), each message's batch applied in sequence
order to what the engine holds (held_blocks.py), which the scheduler then matches prompts' tokens against.

Sequence numbers count from 0 per publisher. A gap (messages lost: the subscriber joined late, or the publisher's
high-water mark) is replayed from the engine's replay socket when one is configured (``kv_events_replay``: a
DEALER sends the first missing sequence; the buffered messages come back, then an end marker); otherwise, or when
the replay does not reach back far enough, what is known of the engine is reset and learnt again from the events
that follow (under-knowing a cache costs a miss; over-knowing it would place work where its prefix is gone).

``live()`` is whether the scheduler should believe it: some message came, no gap is open, and the stream is not
silent, i.e. work that should have stored blocks there (``expect``) was followed by an event within ``silence_s``.
When not live, the scheduler falls back to its mirror of what it placed.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from engines.seam.kv_events import END_SEQ, KVEventBatch, binds, decode_batch, seq_frame, seq_of
from gateway.held_blocks import HeldBlocks

logger = logging.getLogger(__name__)
_REPLAY_TIMEOUT_S = 10.0  # a loaded publisher (its thread shares a GIL with the engine) may take seconds


class KVEventStream:
    def __init__(self, name: str, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 silence_s: float = 5.0, context: zmq.asyncio.Context | None = None):
        self.name = name  # the engine's, for logs
        self.endpoint, self.replay_endpoint, self.topic = endpoint, replay_endpoint, topic
        self.silence_s = silence_s
        self.blocks = HeldBlocks()
        self.next_seq: int | None = None  # the sequence expected next (None: nothing received yet)
        self.messages = self.gaps = self.replayed = self.resets = 0
        self._awaiting_since: float | None = None  # when work that should store blocks went there, unanswered
        self._context = context or zmq.asyncio.Context.instance()
        self._socket: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    # ------------------------------------------------------------ what the scheduler reads

    def live(self) -> bool:
        if self.next_seq is None:
            return False
        return self._awaiting_since is None or time.monotonic() - self._awaiting_since < self.silence_s

    def expect(self) -> None:
        """Work went to the engine that will store new blocks there: an event should follow soon."""
        if self._awaiting_since is None:
            self._awaiting_since = time.monotonic()

    # ------------------------------------------------------------ lifetime

    def open(self) -> None:
        """The SUB socket, subscribed and connected (or bound): messages queue in it from now on."""
        socket = self._context.socket(zmq.SUB)
        socket.setsockopt(zmq.SUBSCRIBE, self.topic.encode())
        socket.setsockopt(zmq.LINGER, 0)
        socket.bind(self.endpoint) if binds(self.endpoint) else socket.connect(self.endpoint)
        self._socket = socket

    def start(self) -> None:
        if self._socket is None:
            self.open()
        self._task = asyncio.create_task(self._run(), name=f"kv-events-{self.name}")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        if self._socket is not None:
            self._socket.close(linger=0)
            self._socket = None

    async def _run(self) -> None:
        assert self._socket is not None
        while True:
            frames = await self._socket.recv_multipart()
            try:
                await self.receive(frames)
            except Exception:  # one bad message must not end the stream
                logger.exception("KV events from %r: a message could not be applied; what is known was reset",
                                 self.name)
                self._reset(None)

    # ------------------------------------------------------------ messages

    async def receive(self, frames: list[bytes]) -> None:
        """One message ``(topic, seq, payload)`` off the SUB socket, applied in order."""
        if len(frames) != 3:
            logger.warning("KV events from %r: a message of %d frames ignored", self.name, len(frames))
            return
        seq = seq_of(frames[1])
        if self.next_seq is not None and seq < self.next_seq:
            return  # already applied (replayed)
        if seq != (self.next_seq if self.next_seq is not None else 0):
            self.gaps += 1
            start = self.next_seq or 0
            if not await self._replay(start, seq):
                self._reset(seq)
        self._apply(seq, frames[2])

    def _apply(self, seq: int, payload: bytes) -> None:
        try:
            batch: KVEventBatch = decode_batch(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            logger.warning("KV events from %r: message %d unreadable (%s); what is known was reset", self.name,
                           seq, exc)
            self._reset(seq + 1)
            return
        self.blocks.apply(batch.events)
        self.messages += 1
        self.next_seq = seq + 1
        self._awaiting_since = None

    def _reset(self, seq: int | None) -> None:
        """Lost track: nothing is known held until events say so again."""
        self.resets += 1
        self.blocks.clear()
        if seq is not None:
            self.next_seq = seq
        logger.info("KV events from %r: lost messages, what is known of its cache reset", self.name)

    async def _replay(self, start: int, until: int) -> bool:
        """Messages ``start`` .. ``until - 1`` from the replay socket, applied; False when there is none or it
        did not reach back to ``start``."""
        if not self.replay_endpoint:
            return False
        dealer = self._context.socket(zmq.DEALER)
        dealer.setsockopt(zmq.LINGER, 0)
        dealer.connect(self.replay_endpoint)
        try:
            await dealer.send_multipart((b"", seq_frame(start)))
            async with asyncio.timeout(_REPLAY_TIMEOUT_S):
                while True:
                    _, _, seq_bytes, payload = await dealer.recv_multipart()
                    if seq_bytes == END_SEQ:
                        break
                    seq = seq_of(seq_bytes)
                    if seq < start or seq >= until:
                        continue
                    if seq != self.next_seq and not (self.next_seq is None and seq == start):
                        return False  # its buffer no longer holds what was missed
                    self._apply(seq, payload)
                    self.replayed += 1
        except (TimeoutError, ValueError, zmq.ZMQError) as exc:
            logger.info("KV events from %r: replay from %d failed (%s)", self.name, start, exc)
            return False
        finally:
            dealer.close(linger=0)
        return self.next_seq == until
