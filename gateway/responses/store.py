"""Stored responses, per API key (owner): what GET /v1/responses/{id} answers and what a next turn's
``previous_response_id`` continues. In memory; bounded per key by count and bytes (the oldest go first),
one response's conversation by ``max_response_bytes`` (413), and by an idle TTL. Another key's response
is not found, as one that never existed."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Callable

import msgspec

from gateway.config import ResponsesConfig
from gateway.domain_errors import NotFound, TooLarge
from wire.responses import Item, Response

_encoder = msgspec.json.Encoder()


class StoredResponse:
    """A response and what it ran on: its own input items and the conversation a next turn continues
    (earlier turns, its input and its output); the task of a background one while it runs."""

    __slots__ = ("response", "input", "earlier", "task", "size", "touched")

    def __init__(self, response: Response, input: list[Item], earlier: list[Item]):
        self.response = response
        self.input = input
        self.earlier = earlier  # the turns before it (previous_response_id's conversation)
        self.task: asyncio.Task | None = None
        self.size = 0
        self.touched = 0.0

    def conversation(self) -> list[Item]:
        return [*self.earlier, *self.input, *self.response.output]

    def measure(self) -> int:
        self.size = len(_encoder.encode(self.response)) + len(_encoder.encode(self.earlier)) + len(
            _encoder.encode(self.input))
        return self.size


def not_found(response_id: str) -> NotFound:
    return NotFound(f"No response found with id '{response_id}'.", param="response_id", code="response_not_found")


class ResponseStore:
    def __init__(self, config: ResponsesConfig, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._clock = clock
        self._by_owner: dict[str, OrderedDict[str, StoredResponse]] = {}
        self._bytes: dict[str, int] = {}
        self.on_drop: Callable[[str], None] = lambda response_id: None  # a response deleted or forgotten

    def check_size(self, earlier: list[Item], input: list[Item]) -> None:
        """A 413 for a turn whose conversation, before its output, is already over the limit."""
        size = len(_encoder.encode(earlier)) + len(_encoder.encode(input))
        if size > self.config.max_response_bytes:
            raise self._too_large(size)

    def _too_large(self, size: int) -> TooLarge:
        return TooLarge(f"this response's conversation is {size} bytes, above this server's limit of "
                        f"{self.config.max_response_bytes} for a stored response: send store=false, or start "
                        "a new conversation", param="previous_response_id", code="response_too_large")

    def put(self, owner: str, stored: StoredResponse) -> None:
        """Stores (or updates) ``stored`` for ``owner``; a 413 when its conversation is over the limit.
        The oldest of the key's responses go when it holds too many or too many bytes."""
        self._expire(owner)
        before = stored.size
        size = stored.measure()
        if size > self.config.max_response_bytes:
            raise self._too_large(size)
        responses = self._by_owner.setdefault(owner, OrderedDict())
        if stored.response.id in responses:
            self._bytes[owner] -= before
        responses[stored.response.id] = stored
        responses.move_to_end(stored.response.id)
        stored.touched = self._clock()
        self._bytes[owner] = self._bytes.get(owner, 0) + size
        while len(responses) > self.config.max_stored or self._bytes[owner] > self.config.max_stored_bytes:
            _, oldest = next(iter(responses.items()))
            if oldest is stored:
                break
            self._drop(owner, oldest)

    def get(self, owner: str, response_id: str) -> StoredResponse:
        self._expire(owner)
        stored = self._by_owner.get(owner, {}).get(response_id)
        if stored is None:
            raise not_found(response_id)
        stored.touched = self._clock()
        return stored

    def delete(self, owner: str, response_id: str) -> StoredResponse:
        stored = self.get(owner, response_id)
        self._drop(owner, stored)
        return stored

    def _drop(self, owner: str, stored: StoredResponse) -> None:
        responses = self._by_owner[owner]
        del responses[stored.response.id]
        self._bytes[owner] -= stored.size
        if stored.task is not None and not stored.task.done():
            stored.task.cancel()
        self.on_drop(stored.response.id)
        if not responses:
            del self._by_owner[owner], self._bytes[owner]

    def _expire(self, owner: str) -> None:
        responses = self._by_owner.get(owner)
        if not responses:
            return
        deadline = self._clock() - self.config.ttl_s
        for stored in [s for s in responses.values() if s.touched < deadline and (s.task is None or s.task.done())]:
            self._drop(owner, stored)
            if owner not in self._by_owner:
                return

    def sweep(self) -> None:
        """Forgets every key's responses that have outlived the TTL (keys that never come back included)."""
        for owner in list(self._by_owner):
            self._expire(owner)

    def __len__(self) -> int:
        return sum(len(r) for r in self._by_owner.values())
