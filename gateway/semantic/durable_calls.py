"""Calls that survive their gateway: each call is recorded in the state store with what it runs, and the replica
running it holds a lease on it, renewed while it runs. When that replica dies (kill -9, the OOM killer) its leases
expire and another replica takes the calls over and runs them again; after a restart on SQLite, the one gateway
takes over every call the previous process left. A call is idempotent until it publishes its outputs, and they
are published once (``write_new``: the first publisher's values are everyone's), so a call run twice binds one
value.

Records (the sessions' TTL, but for the index and the leases):
    calls          {call id: session id}: the calls not ended yet, whoever runs them
    call:{id}      spec: what it runs (CallRecord); out: its outputs, once published (JSON {name: text})
    lease:{id}     holder: the replica running it (gateway/state/leases.py), for ``lease_s``

Its writes go through the session writer (persisted.py), in order with the variables they concern: a call's
record and lease are written before its outputs name it as their producer, and it leaves the index only after
its outputs' values (or errors) are written.
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING, Any, Awaitable, Callable

import msgspec

from gateway.semantic.persisted import Writer
from gateway.state import StateStore, StoreUnavailable, every
from gateway.state.leases import Leases

if TYPE_CHECKING:
    from gateway.semantic.graph import Call

log = logging.getLogger("parrot.state")
INDEX = "calls"


class StepRecord(msgspec.Struct, array_like=True):
    route: str
    body: dict[str, Any]
    output: str


class CallRecord(msgspec.Struct, omit_defaults=True):
    session: str
    steps: list[StepRecord]
    inputs: dict[str, str]  # name -> variable id
    outputs: dict[str, str]
    warm: bool = False
    latency: bool = False


_encode = msgspec.json.Encoder().encode
_call_record = msgspec.json.Decoder(CallRecord).decode
_outputs = msgspec.json.Decoder(dict[str, str]).decode


def call_key(call_id: str) -> str:
    return f"call:{call_id}"


def lease_key(call_id: str) -> str:
    return f"lease:{call_id}"


# Resumes a call taken over: (call id, its record, its outputs if they were published already) -> whether it was
# (False: its session or variables are gone; the call is dropped).
Resume = Callable[[str, CallRecord, "dict[str, str] | None"], Awaitable[bool]]


class DurableCalls:
    def __init__(self, store: StateStore, writer: Writer, *, lease_s: float, ttl_s: float) -> None:
        self.store = store
        self.writer = writer
        self.ttl_s = ttl_s
        self.leases = Leases(store, lease_s)
        self.resume: Resume | None = None
        self.serves: Callable[[str], bool] = lambda model: True  # a model this gateway can run now
        self.taken_over = 0  # calls this process took over
        self._watch: asyncio.Task[None] | None = None

    # ---------------------------------------------------------------- a call's life here (queued writes)

    def added(self, call: Call) -> None:
        """The call runs here: its lease, its record, then its place in the index."""
        spec = call.spec
        assert spec is not None
        record = CallRecord(session=call.session.id, steps=[StepRecord(s.route, s.body, s.output) for s in spec.steps],
                            inputs={n: v.id for n, v in call.inputs.items()},
                            outputs={n: v.id for n, v in call.outputs.items()}, warm=spec.warm, latency=call.latency)
        self.writer.put(self.leases.write_op(lease_key(call.id)),
                        ("write", call_key(call.id), {"spec": _encode(record)}, self.ttl_s),
                        ("write", INDEX, {call.id: call.session.id.encode()}, None))

    async def publish(self, call: Call, results: dict[str, str]) -> dict[str, str]:
        """The call's outputs as published: ``results`` if this is the first publication, else the first's. On a
        store this process alone uses nobody else can have published them (a call a previous process published is
        resumed with its outputs, not run again): they are queued, written in one transaction with their values."""
        if not self.store.shared:
            self.writer.put(("write", call_key(call.id), {"out": _encode(results)}, self.ttl_s))
            return results
        try:
            published = await self.store.write_new(call_key(call.id), "out", _encode(results), ttl_s=self.ttl_s)
        except StoreUnavailable:
            log.warning("call %s: its outputs could not be published (the store is away); bound here", call.id)
            return results
        return results if published == _encode(results) else _outputs(published)

    def ended(self, call: Call) -> None:
        """Its outputs are bound (or failed): out of the index, its lease released, its spec dropped."""
        self.writer.put(("remove_fields", INDEX, [call.id]), self.leases.release_op(lease_key(call.id)),
                        ("remove_fields", call_key(call.id), ["spec"]))

    # ---------------------------------------------------------------- takeovers

    def start(self) -> None:
        self.leases.start()
        self._watch = asyncio.get_running_loop().create_task(
            every(min(1.0, self.leases.lease_s / 4), self.take_over, "taking over calls"), name="call-takeovers")

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        await self.leases.aclose()

    async def take_over(self) -> int:
        """Takes over every call in the index that nobody holds (its replica died, or, on a store this process
        alone uses, a previous process left it); how many it resumed."""
        resumed = 0
        async for call_id, session_id in self.leases.taken_from(INDEX, lease_key):
            key = lease_key(call_id)
            fields = await self.store.read(call_key(call_id))
            if "spec" not in fields:  # expired, or ended meanwhile
                await self._drop(call_id)
                continue
            record = _call_record(fields["spec"])
            if not all(self.serves(s.body.get("model", "")) for s in record.steps):
                await self.store.apply([self.leases.release_op(key)])
                continue  # not yet (an engine still starting)
            published = _outputs(fields["out"]) if "out" in fields else None
            try:
                ok = self.resume is not None and await self.resume(call_id, record, published)
            except BaseException:
                self.leases.held.discard(key)
                raise
            if ok:
                resumed += 1
                self.taken_over += 1
                log.info("call %s of session %s taken over", call_id, session_id.decode())
            else:
                await self._drop(call_id)
        return resumed

    async def _drop(self, call_id: str) -> None:
        await self.store.apply([("remove_fields", INDEX, [call_id]), self.leases.release_op(lease_key(call_id))])

    async def indexed(self, call_id: str) -> bool:
        """Whether the call has not ended (someone runs it, or will take it over)."""
        return await self.store.read_field(INDEX, call_id) is not None
