"""The builtin engine's KV-cache events published as vLLM 0.32.0 publishes them (its ``ZmqEventPublisher``;
docs/kv-events.md): a ZMQ PUB socket sending ``(topic, seq, payload)`` per step that changed the prefix cache, and,
with a replay endpoint, a ROUTER socket answering a start sequence with the buffered messages from it and an end
marker. Like vLLM's, it binds an endpoint with a wildcard (``tcp://*:5557``) or ``ipc://`` / ``inproc://`` and
connects to any other (the subscriber binds there).

Its own thread owns both sockets (ZMQ sockets are not thread-safe): the step loop only puts batches on a queue.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque

import zmq

from engines.seam.kv_events import END_SEQ, binds, KVEvent, KVEventBatch, encode_batch, seq_frame

log = logging.getLogger(__name__)
_POLL_S = 0.05


class KVEventPublisher:
    def __init__(self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
                 buffer_steps: int = 10_000, hwm: int = 100_000):
        self.endpoint, self.replay_endpoint = endpoint, replay_endpoint
        self._topic = topic.encode()
        self._hwm = hwm
        self._queue: queue.Queue[KVEventBatch | None] = queue.Queue()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self.sent = 0  # messages sent so far (the next one's sequence number)
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="kv-event-publisher", daemon=True)
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise ValueError(f"KV events endpoint {endpoint!r}: {self._error}") from self._error

    def publish(self, events: list[KVEvent]) -> None:
        """One step's events, in the order the cache saw them (none: nothing sent)."""
        if events:
            self._queue.put(KVEventBatch(time.time(), events, 0))

    def shutdown(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=5)

    def _sockets(self, context: zmq.Context) -> tuple[zmq.Socket, zmq.Socket | None]:
        pub = context.socket(zmq.PUB)
        pub.set_hwm(self._hwm)
        pub.bind(self.endpoint) if binds(self.endpoint) else pub.connect(self.endpoint)
        replay = None
        if self.replay_endpoint:
            replay = context.socket(zmq.ROUTER)
            replay.bind(self.replay_endpoint)
        return pub, replay

    def _run(self) -> None:
        context = zmq.Context.instance()
        try:
            pub, replay = self._sockets(context)
        except zmq.ZMQError as exc:
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        seq = 0
        try:
            while True:
                if replay is not None and replay.poll(0):
                    self._replay(replay)
                try:
                    batch = self._queue.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if batch is None:
                    return
                payload = encode_batch(batch)
                pub.send_multipart((self._topic, seq_frame(seq), payload))
                self._buffer.append((seq, payload))
                seq += 1
                self.sent = seq
        finally:
            pub.close(linger=0)
            if replay is not None:
                replay.close(linger=0)

    def _replay(self, replay: zmq.Socket) -> None:
        frames = replay.recv_multipart()
        if len(frames) != 3:
            log.warning("KV events: a replay request of %d frames ignored", len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                replay.send_multipart((client, b"", self._topic, seq_frame(seq), payload))
        replay.send_multipart((client, b"", b"", END_SEQ, b""))
