"""All sessions of the gateway: by id and by owner (API key), the default session of each key, the
variables they hold by id, per-key counts against quotas, and which sessions have gone idle."""

from __future__ import annotations

import time
from typing import Callable

from gateway.config import QuotaLimits
from gateway.domain_errors import NotFound, QuotaExceeded
from gateway.semantic.graph import Session, Variable
from gateway.semantic.holdings import Holdings


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

    def create(self, owner: str, *, default: bool = False) -> Session:
        limits = self._limits_of(owner)
        count = self._counts.get(owner, 0)
        if not default and limits.sessions is not None and count >= limits.sessions:
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
                          finished_calls_kept=self._finished_calls_kept, holdings=holdings)
        session.last_used = self._clock()
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
        del self._sessions[session_id]
        if session.default:
            self._defaults.pop(owner, None)
        else:
            self._counts[owner] -= 1
            if not self._counts[owner]:
                del self._counts[owner]
        return session, session.close()

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

    def holdings(self) -> list[Holdings]:
        """Every key's holdings (kept as long as the store: one small record per key that made a session)."""
        return list(self._holdings.values())
