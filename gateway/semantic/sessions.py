"""All sessions of the gateway: by id and by owner (API key), the default session of each key, the
variables they hold by id, per-key counts against quotas, and which sessions have gone idle.

With a state store that keeps them (``mirror``: SQLite, Redis; gateway/semantic/persisted.py) these are the
sessions this process holds: the routes ``fetch`` a session or variable from the store first (made by another
replica, or before a restart), and answer once what they changed is written (``flushed``)."""

from __future__ import annotations

import asyncio
import time
from typing import Callable, Iterable

from gateway.config import QuotaLimits
from gateway.domain_errors import NotFound, QuotaExceeded
from gateway.semantic.graph import Session, Variable, new_id
from gateway.semantic.holdings import Holdings
from gateway.state import StoreUnavailable
from gateway.semantic.persisted import Mirror, VarRecord, lost_producer


class SessionStore:
    """Sessions by id; each belongs to the API key that created it, and other keys see a 404.

    Sessions are kept in the order they were last used (a dict, moved to its end on each use), so
    finding the idle ones reads only the oldest few, never every session."""

    def __init__(self, default_session_max_variables: int | None = None, *,
                 limits_of: Callable[[str], QuotaLimits] | None = None,
                 clock: Callable[[], float] = time.monotonic, finished_calls_kept: int = 1000) -> None:
        self._default_max_variables = default_session_max_variables
        self._finished_calls_kept = finished_calls_kept
        self._limits_of = limits_of or (lambda owner: QuotaLimits())
        self._clock = clock
        self._sessions: dict[str, Session] = {}  # least recently used first
        self._defaults: dict[str, str] = {}
        self._variables: dict[str, Variable] = {}
        self._counts: dict[str, int] = {}  # owner -> its sessions, its default session not counted
        self._holdings: dict[str, Holdings] = {}  # owner -> its calls and pinned prefixes, in all its sessions
        self.mirror: Mirror | None = None  # where sessions are written through to (None: this process only)

    def use(self, mirror: Mirror) -> None:
        """Sessions are written through to ``mirror``'s store and read back from it; its wake-ups bind them here."""
        self.mirror = mirror
        mirror.on_variable = self._announced
        mirror.on_closed = self._closed_elsewhere
        mirror.on_reconnected = self._refresh_pending

    def create(self, owner: str, *, default: bool = False, session_id: str | None = None,
               created: int | None = None, loaded: bool | None = None) -> Session:
        """A new session; ``loaded`` (the default when ``session_id`` is given): one read from the store, which
        is neither held to the key's session quota nor written again."""
        limits = self._limits_of(owner)
        count = self._counts.get(owner, 0)
        loaded = session_id is not None if loaded is None else loaded
        if not default and not loaded and limits.sessions is not None and count >= limits.sessions:
            raise QuotaExceeded(f"this API key already has {count} open sessions, its quota; delete sessions "
                                 "you no longer need", code="sessions_quota_exceeded")
        max_variables = None
        if default:  # forgets its oldest beyond the smaller of the two
            max_variables = min((m for m in (self._default_max_variables, limits.variables_per_session)
                                 if m is not None), default=None)
        holdings = self._holdings.get(owner)
        if holdings is None:
            holdings = self._holdings[owner] = Holdings(limits)
        session = Session(owner, self._variables, default=default, max_variables=max_variables, limits=limits,
                          finished_calls_kept=self._finished_calls_kept, holdings=holdings, session_id=session_id)
        session.last_used = self._clock()
        if created is not None:
            session.created = created
        if self.mirror is not None:
            session.mirror = self.mirror
            if not loaded:
                self.mirror.created(session)
        self._sessions[session.id] = session
        if not default:
            self._counts[owner] = count + 1
        return session

    def get(self, session_id: str, owner: str) -> Session:
        session = self._sessions.get(session_id)
        if session is None or session.owner != owner:
            raise NotFound(f"session {session_id!r} not found", param="session_id", code="session_not_found")
        self.touch(session)
        return session

    def peek(self, session_id: str, owner: str, *, any_owner: bool = False) -> Session:
        """The session, as ``get`` finds it (``any_owner``: whoever owns it), without counting as a use:
        watching a session does not keep it from going idle."""
        session = self._sessions.get(session_id)
        if session is None or not (any_owner or session.owner == owner):
            raise NotFound(f"session {session_id!r} not found", param="session_id", code="session_not_found")
        return session

    def listed(self, owner: str, *, any_owner: bool = False) -> list[Session]:
        """The owner's sessions (``any_owner``: everyone's), most recently used first."""
        return [s for s in reversed(self._sessions.values()) if any_owner or s.owner == owner]

    def touch(self, session: Session) -> None:
        """A use: the session is the most recently used one (and not idle)."""
        session.last_used = self._clock()
        if self._sessions.get(session.id) is session:
            self._sessions[session.id] = self._sessions.pop(session.id)
            if self.mirror is not None:
                self.mirror.touched(session)

    def resolve(self, session_id: str | None, owner: str) -> Session:
        """The named session, or the key's default session (created on first use)."""
        if session_id is not None:
            return self.get(session_id, owner)
        default_id = self._defaults.get(owner)
        if default_id is None or default_id not in self._sessions:
            default_id = self._defaults[owner] = self.create(owner, default=True).id
        session = self._sessions[default_id]
        self.touch(session)
        return session

    def remove(self, session_id: str, owner: str) -> tuple[Session, int]:
        """Closes the session; returns it and how many variables it freed."""
        session = self.get(session_id, owner)
        if session.mirror is not None:
            session.mirror.deleted(session, list(session.variables))
        return session, self._drop(session)

    def _drop(self, session: Session) -> int:
        """Closes the session here (its store records, if any, are left as they are); how many variables it freed."""
        for call in session.calls.values():  # cancelled here: not to be taken over either
            session.call_ended(call)
        session.mirror = None  # what closing does to it is not written through
        if self._sessions.get(session.id) is session:
            del self._sessions[session.id]
        owner = session.owner
        if session.default:
            if self._defaults.get(owner) == session.id:
                self._defaults.pop(owner, None)
        else:
            self._counts[owner] -= 1
            if not self._counts[owner]:
                del self._counts[owner]
        if self.mirror is not None:
            self.mirror.evicted(session.id)
        return session.close()

    def evict(self, session: Session) -> None:
        """Lets go of an idle session held here whose records stay in a shared store (other replicas may use
        it; the store's TTL ends it)."""
        self._drop(session)

    def idle(self, idle_s: float) -> list[Session]:
        """Sessions no request has touched for ``idle_s`` and that run no call, oldest use first. One
        with calls is busy, not idle: it counts as used now."""
        now, idle, busy = self._clock(), [], []
        for session in self._sessions.values():
            if now - session.last_used < idle_s:
                break  # the rest were used later
            (busy if session.calls else idle).append(session)
        for session in busy:
            self.touch(session)
        return idle

    def is_idle(self, session: Session, idle_s: float) -> bool:
        return (not session.closed and not session.calls and self._clock() - session.last_used >= idle_s
                and self._sessions.get(session.id) is session)

    def find_variable(self, var_id: str, owner: str) -> Variable:
        variable = self._variables.get(var_id)
        if variable is None or variable.session.owner != owner:
            raise NotFound(f"variable {var_id!r} not found", code="variable_not_found")
        self.touch(variable.session)
        return variable

    def all(self) -> list[Session]:
        return list(self._sessions.values())

    # ---------------------------------------------------------------- the state store

    async def flushed(self) -> None:
        """Returns once every change made so far is in the state store (StoreUnavailable: it is not)."""
        if self.mirror is not None:
            await self.mirror.flush()

    async def prepare(self, session_id: str | None, owner: str, var_ids: Iterable[str] = ()) -> None:
        """Before ``resolve``: the named session (or the key's default one) held here, with the variables
        ``var_ids`` of it that a request names, as the store has them (not the whole session: a default one may
        hold thousands)."""
        mirror = self.mirror
        if mirror is None:
            return
        if session_id is None:
            session_id = await self._default(owner)
        else:
            await self._hold(session_id)
        session = self._sessions.get(session_id)
        if session is None:
            return  # resolve answers the 404
        for var_id in var_ids:
            variable = session.variables.get(var_id)
            if variable is None or (mirror.shared and not variable.ready and variable.producer is None):
                record = await mirror.read_variable(session_id, var_id)
                if record is not None:
                    await self._merge(session, var_id, record)

    async def _hold(self, session_id: str) -> None:
        """The session held here if the store has it (a shared store's is checked again: it may be gone)."""
        mirror = self.mirror
        assert mirror is not None
        local = self._sessions.get(session_id)
        if local is not None and (not mirror.shared or mirror.listening):
            return  # a deletion elsewhere would have been announced ("closed"), and this copy dropped
        await mirror.flush()  # this process's own changes are in what is read
        meta = await mirror.read_meta(session_id)
        if meta is None:
            self._let_go_of(session_id)
        elif session_id not in self._sessions:  # (the read awaited)
            self.create(meta.owner, default=meta.default, session_id=session_id, created=meta.created)

    def _let_go_of(self, session_id: str) -> None:
        """The store no longer has the session (deleted, or expired, elsewhere): a copy held here goes too,
        unless calls still run in it."""
        local = self._sessions.get(session_id)
        if local is not None and self.mirror is not None and self.mirror.shared and not local.calls:
            self._drop(local)

    async def _default(self, owner: str) -> str:
        """The key's default session, held here: the one the store records, else a new one (recorded)."""
        mirror = self.mirror
        assert mirror is not None
        known = self._defaults.get(owner)
        if known is not None and known in self._sessions:
            if mirror.shared:
                await self._hold(known)  # may have been deleted elsewhere (while wake-ups were away)
            if known in self._sessions:
                return known
        candidate = new_id("sess")
        recorded = await mirror.default_session(owner, candidate)
        if recorded != candidate:
            await self._hold(recorded)
            if recorded in self._sessions:
                self._defaults[owner] = recorded
                return recorded
            await mirror.forget_default(owner)  # it had expired
            await mirror.default_session(owner, candidate)
        self._defaults[owner] = self.create(owner, default=True, session_id=candidate, loaded=False).id
        await self.flushed()  # its record is there before another replica follows the pointer to it
        return candidate

    async def fetch(self, session_id: str) -> None:
        """Brings the session in from the store when it is not held here; from a shared store (another replica
        may have changed it) its variables are read again too. A session the store no longer has is let go."""
        mirror = self.mirror
        if mirror is None:
            return
        local = self._sessions.get(session_id)
        if local is not None and not mirror.shared:
            return
        await mirror.flush()  # this process's own changes are in what is read
        read = await mirror.read_session(session_id)
        if read is None:
            self._let_go_of(session_id)
            return
        local = self._sessions.get(session_id)  # the read awaited
        meta, records = read
        if local is None:
            local = self.create(meta.owner, default=meta.default, session_id=session_id, created=meta.created)
        for var_id, record in records.items():
            await self._merge(local, var_id, record)

    async def fetch_variable(self, var_id: str) -> None:
        """Before ``find_variable``: the variable (and its session) brought in from the store."""
        mirror = self.mirror
        if mirror is None:
            return
        variable = self._variables.get(var_id)
        if variable is not None and (variable.ready or not mirror.shared):
            return  # a value is never bound twice
        await mirror.flush()
        if variable is not None:
            record = await mirror.read_variable(variable.session.id, var_id)
            if record is not None:
                await self._merge(variable.session, var_id, record)
            return
        session_id = await mirror.session_of(var_id)
        if session_id is not None:
            await self.prepare(session_id, "", [var_id])

    async def _merge(self, session: Session, var_id: str, record: VarRecord) -> None:
        """A variable's record from the store, held here: made if new, bound if it was bound elsewhere."""
        variable = session.variables.get(var_id)
        if variable is None:
            if var_id in self._variables or session.closed:
                return
            variable = Variable(session, record.name, var_id=var_id)
            variable.remote_producer = record.producer
            session.adopt(variable)
        if variable.ready or variable.producer is not None:
            return  # bound here, or produced here
        if record.value is not None or record.error is not None:
            variable.settled_elsewhere(record.value, record.error)
        elif record.producer is not None and await self._producer_lost(record):
            variable.remote_producer = None
            variable.fail(lost_producer(record))  # written back: every replica sees it failed
        elif self.mirror.announced_lately(var_id):  # bound while it was being read: read it again
            again = await self.mirror.read_variable(session.id, var_id)
            if again is not None and (again.value is not None or again.error is not None):
                variable.settled_elsewhere(again.value, again.error)

    async def _producer_lost(self, record: VarRecord) -> bool:
        """Its producer ran on a process that is gone and is not to be taken over (it never reached the store's
        calls: durable_calls.py); a call that did is run again by whichever replica takes it over."""
        mirror = self.mirror
        if await mirror.replica_alive(record.replica):
            return False
        return mirror.calls is None or not await mirror.calls.indexed(record.producer)

    def _announced(self, var_id: str) -> None:
        """A variable was bound somewhere: one held here and still pending is read again."""
        variable = self._variables.get(var_id)
        if variable is not None and not variable.ready and variable.producer is None and self.mirror is not None:
            asyncio.get_running_loop().create_task(self._reread(variable))

    async def _reread(self, variable: Variable) -> None:
        try:
            record = await self.mirror.read_variable(variable.session.id, variable.id)
        except StoreUnavailable:
            return  # read again when the subscription is back (_refresh_pending)
        if record is not None:
            await self._merge(variable.session, variable.id, record)

    def _refresh_pending(self) -> None:
        """The store's wake-ups were away a while: every variable waited on here from elsewhere is read again."""
        for variable in list(self._variables.values()):
            self._announced(variable.id)

    def _closed_elsewhere(self, session_id: str) -> None:
        session = self._sessions.get(session_id)
        if session is not None and session.mirror is not None and self.mirror is not None and self.mirror.shared:
            self._drop(session)

    async def check_producers(self) -> int:
        """Variables waited on here whose producer ran on a replica that is gone fail (shared stores); how many."""
        mirror = self.mirror
        if mirror is None or not mirror.shared:
            return 0
        failed = 0
        for variable in [v for v in self._variables.values() if not v.ready and v.remote_producer is not None]:
            record = await mirror.read_variable(variable.session.id, variable.id)
            if record is not None and not variable.ready:
                await self._merge(variable.session, variable.id, record)
                failed += variable.error is not None
        return failed

    def held(self, session_id: str) -> Session | None:
        """The session if this process holds it (after ``fetch``)."""
        return self._sessions.get(session_id)

    def holdings(self) -> list[Holdings]:
        """Every key's holdings (kept as long as the store: one small record per key that made a session)."""
        return list(self._holdings.values())
