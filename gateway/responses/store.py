"""Stored responses, per API key (owner): what GET /v1/responses/{id} answers and what a next turn's
``previous_response_id`` continues. Held in memory, bounded per key by count and bytes (the oldest go first),
one response's conversation by ``max_response_bytes`` (413), and by an idle TTL; and, with a state store that
keeps them (SQLite, Redis: gateway/state/), written through to it (``saved``) and read back from it (``fetch``):
after a restart, or on another replica. Another key's response is not found, as one that never existed.

Bounded per key in the state store too, by ``StateStore.keep`` (exactly across replicas), when there is one.
Record: response:{id}  owner: its key's hash; r: the response, its input and the turns before it (ResponseRecord),
with the responses' TTL; a background response's end is its ``end`` instead (published once: background.py)."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from typing import Callable, Sequence

import msgspec

from gateway.config import ResponsesConfig
from gateway.domain_errors import NotFound, TooLarge
from gateway.state import StateStore
from gateway.state.store import Op
from wire.responses import Item, Response

_encoder = msgspec.json.Encoder()


class ResponseRecord(msgspec.Struct):
    response: Response
    input: list[Item]
    earlier: list[Item]


_record = msgspec.json.Decoder(ResponseRecord).decode


def record_key(response_id: str) -> str:
    return f"response:{response_id}"


def kept_key(owner: str) -> str:
    """The key's responses in the state store, counted against its bounds (``StateStore.keep``)."""
    return f"responses:{owner}"


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
    def __init__(self, config: ResponsesConfig, clock: Callable[[], float] = time.monotonic,
                 state: StateStore | None = None):
        """``state``: the store responses are written through to (None, or one that keeps nothing: memory only)."""
        self.config = config
        self._clock = clock
        self.state = state if state is not None and (state.shared or state.durable) else None
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

    async def saved(self, owner: str, stored: StoredResponse, *, fields: dict[str, bytes] | None = None,
                    before: Sequence[Op] = (), after: Sequence[Op] = ()) -> None:
        """``put``, then written to the state store (StoreUnavailable: it is not; the client gets a 503), with
        ``fields`` more in its record, in one round trip with the writes ``before`` and ``after`` it."""
        self.put(owner, stored)
        if self.state is not None:
            record = _encoder.encode(ResponseRecord(stored.response, stored.input, stored.earlier))
            write = ("write", record_key(stored.response.id), {"owner": owner.encode(), "r": record, **(fields or {})},
                     self.config.ttl_s)
            await self.state.apply([*before, write, *after])
            await self.counted(owner, stored)

    async def counted(self, owner: str, stored: StoredResponse) -> None:
        """``stored`` (written to the state store) counted in its key's bounds there, which every replica shares:
        the key's oldest responses beyond them are deleted, here and in the store."""
        assert self.state is not None
        dropped = await self.state.keep(kept_key(owner), stored.response.id, stored.size, self.config.max_stored,
                                        self.config.max_stored_bytes, self.config.ttl_s)
        if dropped:
            await self.state.remove([record_key(response_id) for response_id in dropped])
            held = self._by_owner.get(owner, {})
            for response_id in dropped:
                if response_id in held:
                    self._drop(owner, held[response_id])

    async def fetch(self, owner: str, response_id: str) -> StoredResponse:
        """``get``, from the state store when it is not held here; from a shared store also when it runs
        elsewhere (a background response another replica updates)."""
        held = self._by_owner.get(owner, {}).get(response_id)
        if self.state is None or (held is not None and (held.task is not None or not self.state.shared)):
            return self.get(owner, response_id)
        fields = await self.state.read(record_key(response_id))
        kept = fields.get("end") or fields.get("r")  # a background response's end, once published
        if fields.get("owner") != owner.encode() or kept is None:
            if held is not None:
                self._drop(owner, held)  # deleted, or expired, elsewhere
            raise not_found(response_id)
        record = _record(kept)
        stored = StoredResponse(record.response, record.input, record.earlier)
        self.put(owner, stored)
        return stored

    async def removed(self, owner: str, response_id: str) -> StoredResponse:
        """``delete``, in the state store too."""
        stored = await self.fetch(owner, response_id)
        self._drop(owner, stored)
        if self.state is not None:
            await self.state.remove([record_key(response_id)])
            await self.state.forget(kept_key(owner), [response_id])
        return stored

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
