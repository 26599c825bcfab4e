"""The embedded default store: one SQLite file (stdlib sqlite3, WAL) that one gateway process owns.

Records live in the file and survive a restart, a crash or kill -9 included (WAL with synchronous=NORMAL: each
commit is in the log before the call returns; only a power loss may take the last ones). Statements are a few
tens of microseconds and run on the event loop, like the rest of the gateway's bookkeeping. Counters (rate
buckets, seats), bounded sets and wake-ups are this process's own, as with one gateway they are exact in memory:
a rate bucket is a minute's state, not worth a disk write per request.
"""

from __future__ import annotations

import fcntl
import os
import sqlite3
import time
from pathlib import Path

from gateway.state.memory import MemoryStore
from gateway.state.store import Listener, StoreUnavailable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS fields (key TEXT NOT NULL, field TEXT NOT NULL, value BLOB NOT NULL,
                                   PRIMARY KEY (key, field)) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS expiry (key TEXT PRIMARY KEY, at REAL NOT NULL) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS expiry_at ON expiry (at);
"""


class SQLiteStore:
    kind = "sqlite"
    shared = False
    durable = True

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._db: sqlite3.Connection | None = None
        self._lock: int | None = None
        self._local = MemoryStore()  # counters and wake-ups

    async def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One gateway per file: a second would take the first's running calls for lost ones. The lock goes with
        # the process, however it ends.
        lock = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(lock)
            raise RuntimeError(f"another gateway process uses the state file {self.path}: give this one a file of "
                               "its own ([state] path, --state PATH), or share a Redis between them "
                               "(--state redis://…)") from None
        self._lock = lock
        db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA busy_timeout=2000")
        db.executescript(_SCHEMA)
        self._db = db

    async def aclose(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None
        if self._lock is not None:
            os.close(self._lock)  # and the lock with it
            self._lock = None

    def _conn(self) -> sqlite3.Connection:
        if self._db is None:
            raise StoreUnavailable("the gateway's state store is closed")
        return self._db

    async def ping(self) -> float:
        started = time.perf_counter()
        try:
            self._conn().execute("SELECT 1").fetchone()
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None
        return time.perf_counter() - started

    # ---------------------------------------------------------------- records

    def _expired(self, db: sqlite3.Connection, key: str) -> bool:
        row = db.execute("SELECT at FROM expiry WHERE key = ?", (key,)).fetchone()
        if row is not None and row[0] <= time.time():
            db.execute("DELETE FROM fields WHERE key = ?", (key,))
            db.execute("DELETE FROM expiry WHERE key = ?", (key,))
            return True
        return False

    async def read(self, key: str) -> dict[str, bytes]:
        try:
            db = self._conn()
            if self._expired(db, key):
                return {}
            return {field: bytes(value) for field, value in
                    db.execute("SELECT field, value FROM fields WHERE key = ?", (key,))}
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None

    async def read_field(self, key: str, field: str) -> bytes | None:
        try:
            db = self._conn()
            if self._expired(db, key):
                return None
            row = db.execute("SELECT value FROM fields WHERE key = ? AND field = ?", (key, field)).fetchone()
            return bytes(row[0]) if row is not None else None
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None

    def _set_ttl(self, db: sqlite3.Connection, key: str, ttl_s: float | None) -> None:
        if ttl_s is not None:
            db.execute("INSERT INTO expiry (key, at) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET at = excluded.at",
                       (key, time.time() + ttl_s))

    async def write(self, key: str, fields: dict[str, bytes], ttl_s: float | None = None) -> None:
        try:
            db = self._conn()
            with db:
                db.execute("BEGIN IMMEDIATE")
                self._expired(db, key)
                db.executemany("INSERT OR REPLACE INTO fields (key, field, value) VALUES (?, ?, ?)",
                               [(key, field, value) for field, value in fields.items()])
                self._set_ttl(db, key, ttl_s)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None

    async def write_new(self, key: str, field: str, value: bytes, ttl_s: float | None = None) -> bytes:
        try:
            db = self._conn()
            with db:
                db.execute("BEGIN IMMEDIATE")
                self._expired(db, key)
                row = db.execute("SELECT value FROM fields WHERE key = ? AND field = ?", (key, field)).fetchone()
                if row is not None:
                    return bytes(row[0])
                db.execute("INSERT INTO fields (key, field, value) VALUES (?, ?, ?)", (key, field, value))
                self._set_ttl(db, key, ttl_s)
                return value
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None

    async def remove_fields(self, key: str, fields: list[str]) -> None:
        try:
            db = self._conn()
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.executemany("DELETE FROM fields WHERE key = ? AND field = ?", [(key, f) for f in fields])
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None

    async def remove(self, keys: list[str]) -> None:
        try:
            db = self._conn()
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.executemany("DELETE FROM fields WHERE key = ?", [(k,) for k in keys])
                db.executemany("DELETE FROM expiry WHERE key = ?", [(k,) for k in keys])
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None

    async def expire(self, key: str, ttl_s: float) -> None:
        try:
            db = self._conn()
            with db:
                db.execute("BEGIN IMMEDIATE")
                if db.execute("SELECT 1 FROM fields WHERE key = ? LIMIT 1", (key,)).fetchone() is not None:
                    self._set_ttl(db, key, ttl_s)
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None

    async def lease(self, key: str, holder: str, ttl_s: float) -> bool:
        try:
            db = self._conn()
            with db:
                db.execute("BEGIN IMMEDIATE")
                self._expired(db, key)
                row = db.execute("SELECT value FROM fields WHERE key = ? AND field = 'holder'", (key,)).fetchone()
                if row is not None and bytes(row[0]) != holder.encode():
                    return False
                db.execute("INSERT OR REPLACE INTO fields (key, field, value) VALUES (?, 'holder', ?)",
                           (key, holder.encode()))
                self._set_ttl(db, key, ttl_s)
                return True
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None

    async def apply(self, ops: list[tuple]) -> None:
        """In one transaction (one commit for the batch); wake-ups after it. Consecutive writes go as one statement
        (and their TTLs as another), each record checked for expiry once: a batch is a request's writes, and
        statements, not rows, are what costs."""
        try:
            db = self._conn()
            published: list[tuple[str, bytes]] = []
            with db:
                db.execute("BEGIN IMMEDIATE")
                writes = _Writes(self, db)
                for op in ops:
                    kind = op[0]
                    if kind == "write":
                        writes.add(op[1], op[2], op[3])
                        continue
                    writes.flush()  # in order with what follows
                    if kind == "remove_fields":
                        db.executemany("DELETE FROM fields WHERE key = ? AND field = ?", [(op[1], f) for f in op[2]])
                    elif kind == "remove":
                        db.executemany("DELETE FROM fields WHERE key = ?", [(k,) for k in op[1]])
                        db.executemany("DELETE FROM expiry WHERE key = ?", [(k,) for k in op[1]])
                    elif kind == "expire":
                        if db.execute("SELECT 1 FROM fields WHERE key = ? LIMIT 1", (op[1],)).fetchone() is not None:
                            self._set_ttl(db, op[1], op[2])
                    elif kind == "publish":
                        published.append((op[1], op[2]))
                    elif kind == "remove_if":
                        row = db.execute("SELECT value FROM fields WHERE key = ? AND field = ?", (op[1], op[2])).fetchone()
                        if row is not None and bytes(row[0]) == op[3]:
                            db.execute("DELETE FROM fields WHERE key = ?", (op[1],))
                            db.execute("DELETE FROM expiry WHERE key = ?", (op[1],))
                    else:
                        raise ValueError(f"unknown state operation {kind!r}")
                writes.flush()
        except sqlite3.Error as exc:
            raise StoreUnavailable(f"the gateway's state store (SQLite) failed: {exc}") from None
        for channel, message in published:
            await self._local.publish(channel, message)

    def forget_full(self) -> int:
        """Expired records deleted (a TTL is otherwise enforced when the record is read) and idle counters dropped."""
        forgotten = self._local.forget_full()
        if self._db is None:
            return forgotten
        try:
            with self._db as db:
                db.execute("BEGIN IMMEDIATE")
                now = time.time()
                db.execute("DELETE FROM fields WHERE key IN (SELECT key FROM expiry WHERE at <= ?)", (now,))
                forgotten += db.execute("DELETE FROM expiry WHERE at <= ?", (now,)).rowcount
        except sqlite3.Error:
            pass  # the next sweep tries again
        return forgotten

    # ---------------------------------------------------------------- counters, bounded sets and wake-ups: this process's

    async def take(self, key: str, capacity: float, per_s: float, cost: float, need: float) -> tuple[bool, float]:
        return self._local.take_now(key, capacity, per_s, cost, need)

    async def seat(self, key: str, limit: int | None, ttl_s: float) -> bool:
        return self._local.seat_now(key, limit, ttl_s)

    async def unseat(self, key: str) -> None:
        self._local.unseat_now(key)

    async def keep(self, key: str, member: str, size: int, max_count: int, max_bytes: int,
                   ttl_s: float) -> list[str]:
        return self._local.keep_now(key, member, size, max_count, max_bytes, ttl_s)

    async def forget(self, key: str, members: list[str]) -> None:
        self._local.forget_now(key, members)

    async def publish(self, channel: str, message: bytes) -> None:
        await self._local.publish(channel, message)

    def subscribe(self, channel: str, listener: Listener) -> None:
        self._local.subscribe(channel, listener)

    @property
    def counters(self) -> MemoryStore:
        return self._local


class _Writes:
    """Consecutive "write" ops of a batch, written as two statements (their fields, their TTLs) when another kind
    of op comes, or the batch ends; each record checked for expiry before its first write in the batch."""

    def __init__(self, store: SQLiteStore, db: sqlite3.Connection) -> None:
        self._store = store
        self._db = db
        self._now = time.time()
        self._checked: set[str] = set()
        self._rows: list[tuple[str, str, bytes]] = []
        self._expiry: dict[str, float] = {}

    def add(self, key: str, fields: dict[str, bytes], ttl_s: float | None) -> None:
        if key not in self._checked:
            self._store._expired(self._db, key)
            self._checked.add(key)
        self._rows.extend((key, field, value) for field, value in fields.items())
        if ttl_s is not None:
            self._expiry[key] = self._now + ttl_s

    def flush(self) -> None:
        if self._rows:
            self._db.executemany("INSERT OR REPLACE INTO fields (key, field, value) VALUES (?, ?, ?)", self._rows)
            self._rows = []
        if self._expiry:
            self._db.executemany("INSERT INTO expiry (key, at) VALUES (?, ?) ON CONFLICT (key) DO UPDATE SET "
                                 "at = excluded.at", list(self._expiry.items()))
            self._expiry = {}
