"""Background responses that survive their gateway, as semantic calls do (gateway/semantic/durable_calls.py):
each one is recorded in the state store with what it runs, and the replica running it holds a lease on it,
renewed while it runs. When that replica dies its lease expires and another replica (or this gateway, restarted
on its SQLite file) runs the response again from the start: a response is idempotent until it ends, and its end
is published once (``write_new``: a replica cut off from the store that finishes it too adopts the first end).

Records:
    background           {response id: owner}: the background responses not ended yet, whoever runs them
    response:{id}        run: what it runs (RunRecord), while it runs; end: the response as it ended (a
                         ResponseRecord, which readers prefer to ``r``) (gateway/responses/store.py)
    lease:response:{id}  holder: the replica running it (gateway/state/leases.py), for ``lease_s``
A cancel (or delete) on one replica is published on the channel ``responses:stop`` so that the replica running the
response stops it.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable

import msgspec

from gateway.responses.store import ResponseRecord, ResponseStore, StoredResponse, record_key
from gateway.state import StateStore, StoreUnavailable, every
from gateway.state.leases import Leases
from wire.responses import ResponsesRequest

log = logging.getLogger("parrot.responses")
INDEX = "background"
STOP = "responses:stop"


class RunRecord(msgspec.Struct, omit_defaults=True):
    """What a background response runs, as ``ResponsesService.prepare`` made it (its response, input and
    conversation are the ResponseRecord's)."""

    request: ResponsesRequest
    chat: dict[str, Any]
    estimate: int = 0
    parrot: dict[str, Any] | None = None
    upstream: dict[str, Any] | None = None


_encode = msgspec.json.Encoder().encode
_run_record = msgspec.json.Decoder(RunRecord).decode
_response_record = msgspec.json.Decoder(ResponseRecord).decode


def lease_key(response_id: str) -> str:
    return f"lease:response:{response_id}"


# Runs a response taken over, by a task of its own: (owner, the response as stored, what it runs).
Resume = Callable[[str, StoredResponse, RunRecord], None]


class BackgroundRuns:
    def __init__(self, responses: ResponseStore, *, lease_s: float) -> None:
        self.responses = responses
        self.store: StateStore | None = responses.state  # None: kept in memory only, nothing to take over
        self.leases = Leases(self.store, lease_s) if self.store is not None else None
        self.running: dict[str, asyncio.Task[None]] = {}  # response id -> its task here
        self.resume: Resume | None = None
        self.closing = False  # the gateway stops: what runs here is left to be taken over, not ended
        self.taken_over = 0
        self._watch: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- a response's life here

    async def started(self, owner: str, stored: StoredResponse, run: RunRecord) -> None:
        """Stores the queued response: its lease, its record with what it runs, then its place in the index."""
        if self.store is None or self.leases is None:
            await self.responses.saved(owner, stored)
            return
        key = lease_key(stored.response.id)
        try:
            await self.responses.saved(owner, stored, fields={"run": _encode(run)}, before=[self.leases.write_op(key)],
                                       after=[("write", INDEX, {stored.response.id: owner.encode()}, None)])
        except BaseException:
            self.leases.held.discard(key)  # not recorded: nothing to renew
            raise

    def running_here(self, response_id: str, task: asyncio.Task[None]) -> None:
        self.running[response_id] = task
        task.add_done_callback(lambda _: self.running.pop(response_id, None))

    async def ended(self, owner: str, stored: StoredResponse) -> None:
        """Publishes the response's end (once: a replica that ended it first wins, and its end is adopted here),
        then takes it out of the index and releases its lease. TooLarge: its end is over the size limit."""
        self.responses.put(owner, stored)  # measured again, now with its output
        if self.store is None or self.leases is None:
            return
        response_id = stored.response.id
        mine = _encode(ResponseRecord(stored.response, stored.input, stored.earlier))
        try:
            published = await self.store.write_new(record_key(response_id), "end", mine,
                                                   ttl_s=self.responses.config.ttl_s)
        except StoreUnavailable:
            self.leases.held.discard(lease_key(response_id))  # still indexed: run again once the store is back
            raise
        if published != mine:
            first = _response_record(published)
            stored.response, stored.input, stored.earlier = first.response, first.input, first.earlier
        await self.store.apply([("remove_fields", record_key(response_id), ["run", "r"]),
                                ("remove_fields", INDEX, [response_id]), self.leases.release_op(lease_key(response_id))])
        await self.responses.counted(owner, stored)

    async def stop_elsewhere(self, response_id: str) -> None:
        """Asks the replica running the response (if another) to stop it: cancelled, or deleted."""
        if self.store is not None and self.store.shared:
            await self.store.publish(STOP, response_id.encode())

    def _stop(self, message: bytes) -> None:
        task = self.running.get(message.decode())
        if task is not None:
            task.cancel()

    # ---------------------------------------------------------------- takeovers

    def start(self) -> None:
        if self.store is None or self.leases is None:
            return
        self.store.subscribe(STOP, self._stop)
        self.leases.start()
        self._watch = asyncio.get_running_loop().create_task(
            every(min(1.0, self.leases.lease_s / 4), self.take_over, "taking over background responses"),
            name="background-takeovers")

    async def aclose(self) -> None:
        """Stops what runs here without ending it, and releases its leases: another replica (or this gateway
        started again) runs it."""
        self.closing = True
        tasks = [*([self._watch] if self._watch is not None else []), *self.running.values()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        if self.leases is not None:
            await self.leases.aclose()

    async def take_over(self) -> int:
        """Runs again every background response in the index that nobody holds (its replica died, or, on a store
        this process alone uses, a previous process left it); how many."""
        assert self.store is not None and self.leases is not None
        resumed = 0
        async for response_id, owner in self.leases.taken_from(INDEX, lease_key):
            fields = await self.store.read(record_key(response_id))
            if "run" not in fields or "r" not in fields or "end" in fields or self.resume is None:
                await self._drop(response_id)  # ended (or cancelled) meanwhile, deleted or expired
                continue
            record = _response_record(fields["r"])
            stored = StoredResponse(record.response, record.input, record.earlier)
            self.responses.put(owner.decode(), stored)
            self.resume(owner.decode(), stored, _run_record(fields["run"]))
            resumed += 1
            self.taken_over += 1
            log.info("background response %s taken over", response_id)
        return resumed

    async def _drop(self, response_id: str) -> None:
        assert self.store is not None and self.leases is not None
        await self.store.apply([("remove_fields", INDEX, [response_id]), self.leases.release_op(lease_key(response_id))])
