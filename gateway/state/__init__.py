"""The gateway's state seam (store.py) and the store a configuration names. It imports nothing of the gateway
(the core imports it)."""

from __future__ import annotations

import os
from pathlib import Path

from gateway.state.memory import MemoryStore
from gateway.state.store import StateStore, StoreUnavailable, every, redacted

__all__ = ["MemoryStore", "StateStore", "StoreUnavailable", "data_dir", "every", "open_store"]

# The store of a configuration that names none: None, the SQLite file in the data directory. The test suite sets
# "memory://", so that the many gateways one test process starts do not share one file.
UNCONFIGURED_URL: str | None = None


def data_dir() -> Path:
    """$PARROT_DATA_DIR, else $XDG_DATA_HOME/parrot, else ~/.local/share/parrot."""
    if os.environ.get("PARROT_DATA_DIR"):
        return Path(os.environ["PARROT_DATA_DIR"])
    base = os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share"
    return Path(base) / "parrot"


def open_store(config: "StateConfig") -> StateStore:  # gateway.config's
    """The store ``config`` names (not started yet)."""
    url = config.url
    if url is None and config.path is None:
        url = UNCONFIGURED_URL
    if url is None:
        from gateway.state.sqlite import SQLiteStore

        return SQLiteStore(Path(config.path).expanduser() if config.path else data_dir() / "state.sqlite3")
    if url.startswith("memory://"):
        return MemoryStore()
    from gateway.state.redis_store import RedisStore  # the redis package is imported only when used

    return RedisStore(url, timeout_s=config.timeout_s)


def describe(config: "StateConfig") -> str:
    """Where the state lives, for the startup line (no password)."""
    if config.url:
        return redacted(config.url)
    if config.path is None and UNCONFIGURED_URL:
        return UNCONFIGURED_URL
    return str(Path(config.path).expanduser() if config.path else data_dir() / "state.sqlite3")
