"""Sessions and variables written through to the state store (gateway/state/) and read back from it: by another
gateway replica sharing the store (Redis), or by this gateway after a restart (SQLite).

What a process holds in memory stays its working set (the graph, its calls and their tasks); the store holds
what another process needs to carry on: each session's owner, and each variable's name, value or error, and
producer. Changes made by the graph's synchronous code are queued in order and written by one task; a request
is answered only once what it changed is written (``flush``), so nothing acknowledged is lost when the process
is. A variable bound here is announced on the store's ``vars`` channel: a replica with a waiter on it reads its
value then, instead of polling.

Records, each with the sessions' TTL:
    session:{id}   _meta: {owner, default, created};  v:{var id}: the variable (VarRecord)
    var:{id}       s: the id of its session (lookups by variable id alone)
    default:{owner} s: the id of the key's default session
    replica:{id}   alive: a replica's heartbeat (shared stores): a pending variable whose producer ran on a
                   replica that is gone is taken over with its call (durable_calls.py), or, when the call never
                   reached the store's calls, fails instead of waiting for its input timeout
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Callable

import msgspec

from gateway.state import StateStore, StoreUnavailable
from gateway.state.leases import REPLICA  # a pending variable's record names the replica that runs its producer

if TYPE_CHECKING:
    from gateway.semantic.durable_calls import DurableCalls
    from gateway.semantic.graph import Call, Session, Variable

log = logging.getLogger("parrot.state")

_HEARTBEAT_S = 3.0
_HEARTBEAT_TTL_S = 10.0


class SessionRecord(msgspec.Struct, omit_defaults=True):
    owner: str
    default: bool = False
    created: int = 0


class VarRecord(msgspec.Struct, omit_defaults=True):
    name: str | None = None
    value: str | None = None
    error: str | None = None
    producer: str | None = None  # its producer call's id
    replica: str | None = None  # the replica that runs that call


_encode = msgspec.json.Encoder().encode
_session_record = msgspec.json.Decoder(SessionRecord).decode
_var_record = msgspec.json.Decoder(VarRecord).decode


def session_key(session_id: str) -> str:
    return f"session:{session_id}"


def var_key(var_id: str) -> str:
    return f"var:{var_id}"


def lost_producer(record: VarRecord) -> str:
    return (f"its producer {record.producer} was lost with the gateway process that ran it (a restart, or a "
            "replica that died); submit the call again")


class Writer:
    """Writes in the order they were queued, by one task: whatever is queued when it turns is applied as one batch
    (one round trip; one transaction on SQLite). While the store is away a batch is retried every half second
    until it is back: nothing queued is dropped, and ``flush`` fails meanwhile."""

    _BATCH = 512

    def __init__(self, store: StateStore) -> None:
        self._store = store
        self._queue: collections.deque[tuple[int, tuple]] = collections.deque()
        self._queued = 0  # sequence number of the last write queued
        self._written = 0  # ... and of the last one written
        self._waiters: list[tuple[int, asyncio.Future[None]]] = []
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._closed = False
        self.failures = 0
        self.observe: Callable[[float], None] = lambda seconds: None  # each batch's round trip (metrics)

    def put(self, *ops: tuple) -> None:
        if self._closed:  # the gateway is shutting down: its sessions closing are not news to the store
            return
        for op in ops:
            self._queued += 1
            self._queue.append((self._queued, op))
        self._wake.set()
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run(), name="state-writer")

    @property
    def pending(self) -> int:
        return len(self._queue)

    async def flush(self) -> None:
        """Returns once everything queued so far is written; StoreUnavailable if the store fails meanwhile (the
        writes stay queued and are written once it is back)."""
        target = self._queued
        if self._written >= target:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._waiters.append((target, waiter))
        await waiter

    async def aclose(self, timeout_s: float = 5.0) -> None:
        self._closed = True
        if self._task is not None:
            try:
                await asyncio.wait_for(self.flush(), timeout_s)
            except (StoreUnavailable, asyncio.TimeoutError):
                log.warning("%d state writes were not written before shutdown", len(self._queue))
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def _run(self) -> None:
        while True:
            if not self._queue:
                self._wake.clear()
                await self._wake.wait()
                continue
            batch = [self._queue[i] for i in range(min(len(self._queue), self._BATCH))]
            started = time.perf_counter()
            try:
                await self._store.apply([op for _, op in batch])
                self.observe(time.perf_counter() - started)
            except StoreUnavailable as exc:
                self.failures += 1
                waiters, self._waiters = self._waiters, []
                for _, waiter in waiters:
                    if not waiter.done():
                        waiter.set_exception(StoreUnavailable(exc.message))
                await asyncio.sleep(0.5)
                continue
            except Exception:  # a bug, not the store: the batch is dropped, the rest go on
                log.exception("state writes failed")
            for _ in batch:
                self._queue.popleft()
            seq = self._written = batch[-1][0]
            if self._waiters:
                done = [w for w in self._waiters if w[0] <= seq]
                self._waiters = [w for w in self._waiters if w[0] > seq]
                for _, waiter in done:
                    if not waiter.done():
                        waiter.set_result(None)


class Mirror:
    """The semantic layer's side of the state store: what is written, read, and announced."""

    def __init__(self, store: StateStore, ttl_s: float) -> None:
        self.store = store
        self.shared = store.shared
        # A shared store's TTL is the sessions' idle expiry (each replica only lets go of its copy); this process's
        # own store is swept as the sessions in memory are, its TTL only a backstop for a restart.
        self.ttl_s = ttl_s if store.shared else ttl_s + 60.0
        self.writer = Writer(store)
        self._refreshed: dict[str, float] = {}  # session id -> when its TTLs were last refreshed
        self._announced: collections.OrderedDict[str, None] = collections.OrderedDict()  # recent, not held here
        self.on_variable: Callable[[str], None] = lambda var_id: None
        self.on_closed: Callable[[str], None] = lambda session_id: None
        self.on_reconnected: Callable[[], None] = lambda: None
        self._heartbeat: asyncio.Task[None] | None = None
        self.calls: DurableCalls | None = None  # the calls' records and leases (durable_calls.py)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self.store.subscribe("vars", lambda message: self._variable_announced(message.decode()))
        self.store.subscribe("closed", lambda message: self.on_closed(message.decode()))
        if self.shared:
            subscribed = getattr(self.store, "on_subscribed", None)
            if subscribed is not None:
                subscribed(lambda: self.on_reconnected())
            self._heartbeat = asyncio.get_running_loop().create_task(self._beat(), name="state-heartbeat")

    async def aclose(self) -> None:
        if self._heartbeat is not None:
            self._heartbeat.cancel()
            await asyncio.gather(self._heartbeat, return_exceptions=True)
        await self.writer.aclose()
        if self.calls is not None:
            await self.calls.aclose()
        if self.shared:
            try:
                await self.store.remove([f"replica:{REPLICA}"])
            except StoreUnavailable:
                pass

    async def _beat(self) -> None:
        while True:
            try:
                await self.store.write(f"replica:{REPLICA}", {"alive": b"1"}, ttl_s=_HEARTBEAT_TTL_S)
            except StoreUnavailable:
                pass
            await asyncio.sleep(_HEARTBEAT_S)

    async def replica_alive(self, replica: str | None) -> bool:
        if replica is None or replica == REPLICA:
            return True
        if not self.shared:
            return False  # this process owns the store: an earlier one is gone
        return bool(await self.store.read_field(f"replica:{replica}", "alive"))

    @property
    def listening(self) -> bool:
        """The store's wake-ups reach this process now (a shared store's subscription is up)."""
        subscribed = getattr(self.store, "subscribed", None)
        return True if subscribed is None else subscribed

    def _variable_announced(self, var_id: str) -> None:
        self._announced[var_id] = None
        if len(self._announced) > 4096:
            self._announced.popitem(last=False)
        self.on_variable(var_id)

    def announced_lately(self, var_id: str) -> bool:
        """Whether a wake-up for it came (it may have come while this process was reading it)."""
        return var_id in self._announced

    # ---------------------------------------------------------------- writes (queued, in order)

    def created(self, session: Session) -> None:
        record = _encode(SessionRecord(owner=session.owner, default=session.default, created=session.created))
        self.writer.put(("write", session_key(session.id), {"_meta": record}, self.ttl_s))
        self._refreshed[session.id] = time.monotonic()

    def changed(self, session: Session, variable: Variable) -> None:
        record = _encode(VarRecord(name=variable.name, value=variable.value, error=variable.error,
                                   producer=variable.producer_id,
                                   replica=REPLICA if variable.producer is not None else None))
        ops = [("write", session_key(session.id), {f"v:{variable.id}": record}, self.ttl_s),
               ("write", var_key(variable.id), {"s": session.id.encode()}, self.ttl_s)]
        if variable.ready:
            ops.append(("publish", "vars", variable.id.encode()))
        self.writer.put(*ops)

    def call_added(self, call: Call) -> None:
        if self.calls is not None:
            self.calls.added(call)

    def call_ended(self, call: Call) -> None:
        if self.calls is not None:
            self.calls.ended(call)

    async def published(self, call: Call, results: dict[str, str]) -> dict[str, str]:
        return results if self.calls is None else await self.calls.publish(call, results)

    def forgotten(self, session: Session, var_ids: list[str]) -> None:
        self.writer.put(("remove_fields", session_key(session.id), [f"v:{v}" for v in var_ids]),
                        ("remove", [var_key(v) for v in var_ids]))

    def deleted(self, session: Session, var_ids: list[str]) -> None:
        if session.default:
            self.writer.put(("remove_if", f"default:{session.owner}", "s", session.id.encode()))
        self.writer.put(("remove", [session_key(session.id), *(var_key(v) for v in var_ids)]),
                        ("publish", "closed", session.id.encode()))
        self._refreshed.pop(session.id, None)

    def touched(self, session: Session) -> None:
        """A use: the session's records live another TTL (refreshed at most every quarter TTL)."""
        now = time.monotonic()
        if now - self._refreshed.get(session.id, 0.0) < self.ttl_s / 4:
            return
        self._refreshed[session.id] = now
        keys = [session_key(session.id), *(var_key(v) for v in session.variables)]
        if session.default:
            keys.append(f"default:{session.owner}")
        self.writer.put(*(("expire", key, self.ttl_s) for key in keys))

    def evicted(self, session_id: str) -> None:
        self._refreshed.pop(session_id, None)

    async def flush(self) -> None:
        await self.writer.flush()

    # ---------------------------------------------------------------- reads

    async def read_session(self, session_id: str) -> tuple[SessionRecord, dict[str, VarRecord]] | None:
        fields = await self.store.read(session_key(session_id))
        meta = fields.pop("_meta", None)
        if meta is None:
            return None
        return _session_record(meta), {f[2:]: _var_record(v) for f, v in fields.items() if f.startswith("v:")}

    async def read_meta(self, session_id: str) -> SessionRecord | None:
        raw = await self.store.read_field(session_key(session_id), "_meta")
        return _session_record(raw) if raw is not None else None

    async def read_variable(self, session_id: str, var_id: str) -> VarRecord | None:
        raw = await self.store.read_field(session_key(session_id), f"v:{var_id}")
        return _var_record(raw) if raw is not None else None

    async def session_of(self, var_id: str) -> str | None:
        raw = await self.store.read_field(var_key(var_id), "s")
        return raw.decode() if raw is not None else None

    async def default_session(self, owner: str, candidate: str) -> str:
        """The key's default session: the one recorded, else ``candidate`` (recorded now, atomically)."""
        return (await self.store.write_new(f"default:{owner}", "s", candidate.encode(), ttl_s=self.ttl_s)).decode()

    async def forget_default(self, owner: str) -> None:
        await self.store.remove([f"default:{owner}"])
