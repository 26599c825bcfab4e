"""The gateway's KV-event streams, one per engine configured with ``kv_events`` (gateway/kv_events.py), and what
the request path needs of them: the blocks an engine holds while its stream is live (the scheduler's ``exact``), a
prompt's token ids to match against them (asked of an engine of the model: ``POST /tokenize``, remembered), and
the note that work which will store blocks went to an engine (its stream falls silent if no event follows).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Sequence

from engines.seam import EngineError, Route, TokenizingEngine
from engines.seam.connect import has_capability
from gateway.config import KVEventsConfig, UpstreamConfig
from gateway.held_blocks import HeldBlocks
from gateway.kv_events import KVEventStream
from gateway.prompt_prefix import rendered
from gateway.registry import EngineRecord

logger = logging.getLogger(__name__)


class EngineEvents:
    def __init__(self, config: KVEventsConfig):
        self.config = config
        self.streams: dict[str, KVEventStream] = {}  # engine id -> its stream
        self._tokenized: OrderedDict[tuple[str, bytes], tuple[int, ...]] = OrderedDict()
        self._turn = 0

    def add(self, record: EngineRecord, upstream: UpstreamConfig) -> None:
        assert upstream.kv_events is not None
        self.streams[record.id] = KVEventStream(record.engine.name, upstream.kv_events,
                                                replay_endpoint=upstream.kv_events_replay,
                                                topic=upstream.kv_events_topic, silence_s=self.config.silence_s)

    def start(self) -> None:
        for stream in self.streams.values():
            stream.start()

    async def aclose(self) -> None:
        for stream in self.streams.values():
            await stream.aclose()

    def exact(self, engine_id: str) -> HeldBlocks | None:
        """The blocks ``engine_id`` holds, by its live events; None without them (the scheduler's mirror counts)."""
        stream = self.streams.get(engine_id)
        return stream.blocks if stream is not None and stream.live() else None

    def live(self, records: Sequence[EngineRecord]) -> list[EngineRecord]:
        return [r for r in records if self.exact(r.id) is not None and has_capability(r.engine, TokenizingEngine)]

    async def token_ids(self, route: Route, body: dict[str, Any], records: Sequence[EngineRecord]) -> tuple[int, ...]:
        """``body``'s prompt as token ids when some of ``records`` have live events (else, or when no engine could
        say, empty: the work is matched by its rendered bytes alone). Asked of those engines in turn (one model,
        one tokenizer), remembered by the prompt's bytes."""
        live = self.live(records)
        if not live:
            return ()
        key = (str(body.get("model")), route.encode() + rendered(route, body) + _rendering(body))
        known = self._tokenized.get(key)
        if known is not None:
            self._tokenized.move_to_end(key)
            return known
        self._turn += 1
        engine = live[self._turn % len(live)].engine
        try:
            tokens = tuple(await engine.tokenize(route, body))  # type: ignore[attr-defined]
        except EngineError as exc:
            logger.debug("tokenizing a prompt on %r failed: %s", engine.name, exc)
            return ()
        self._tokenized[key] = tokens
        if len(self._tokenized) > self.config.tokenized_prompts:
            self._tokenized.popitem(last=False)
        return tokens

    def expect(self, record: EngineRecord, token_ids: Sequence[int]) -> None:
        """Work of ``token_ids`` went to ``record``'s engine: when it will store a new full block there, an event
        should follow (else the stream went silent)."""
        stream = self.streams.get(record.id)
        if stream is None or not token_ids:
            return
        blocks = stream.blocks
        blocks.placed(token_ids)
        if not blocks.block_size or len(token_ids) - blocks.held_tokens(token_ids) >= blocks.block_size:
            stream.expect()


def _rendering(body: dict[str, Any]) -> bytes:
    """What besides the messages changes a chat prompt's tokens (a prefill's open last message)."""
    return b"|continue" if body.get("continue_final_message") else b""
