"""Leases this process holds in the state store: work that one replica runs at a time (a semantic call, a batch),
renewed every third of their term while held. When the process dies its leases expire, and another replica (or
this gateway restarted on its SQLite file, at once) takes the work over."""

from __future__ import annotations

import asyncio
import logging
import secrets
from typing import AsyncIterator, Callable

from gateway.state.store import StateStore, StoreUnavailable

log = logging.getLogger("parrot.state")

# This process, as the holder of its leases (and the replica that its records name).
REPLICA = secrets.token_hex(8)


class Leases:
    def __init__(self, store: StateStore, lease_s: float) -> None:
        self.store = store
        self.lease_s = lease_s
        self.held: set[str] = set()  # lease keys
        self._renewer: asyncio.Task[None] | None = None

    def write_op(self, key: str) -> tuple:
        """The write (an ``apply`` op) that takes ``key`` for this process, unconditionally: for work it has just
        made, written in order with the records that announce it."""
        self.held.add(key)
        return ("write", key, {"holder": REPLICA.encode()}, self.lease_s)

    def release_op(self, key: str) -> tuple:
        self.held.discard(key)
        return ("remove_if", key, "holder", REPLICA.encode())

    async def take(self, key: str) -> bool:
        """Takes ``key`` if nobody holds it, or (on a store only this process uses) a previous process did."""
        if await self.store.lease(key, REPLICA, self.lease_s):
            self.held.add(key)
            return True
        if self.store.shared:
            return False  # another replica holds it
        await self.store.write(key, {"holder": REPLICA.encode()}, ttl_s=self.lease_s)
        self.held.add(key)
        return True

    async def taken_from(self, index: str, lease_key: Callable[[str], str]) -> AsyncIterator[tuple[str, bytes]]:
        """The entries of ``index`` (a hash of work ids) whose lease nobody held and this process has now taken:
        work whose replica died, or, on a store this process alone uses, that a previous process left."""
        for work_id, value in (await self.store.read(index)).items():
            key = lease_key(work_id)
            if key in self.held or not await self.take(key):
                continue  # run here, or by a live replica
            yield work_id, value

    def start(self) -> None:
        if self._renewer is None:
            self._renewer = asyncio.get_running_loop().create_task(self._renew(), name="leases")

    async def aclose(self) -> None:
        """Stops renewing, and releases what is held: on a clean stop other replicas take it over now."""
        if self._renewer is not None:
            self._renewer.cancel()
            await asyncio.gather(self._renewer, return_exceptions=True)
            self._renewer = None
        if self.held:
            try:
                await self.store.apply([self.release_op(key) for key in list(self.held)])
            except StoreUnavailable:
                pass

    async def _renew(self) -> None:
        while True:
            await asyncio.sleep(self.lease_s / 3)
            for key in list(self.held):
                try:
                    if not await self.store.lease(key, REPLICA, self.lease_s) and key in self.held:
                        # Taken by another replica (this one was cut off from the store longer than a lease): both
                        # run the work; what it publishes is published once.
                        log.warning("lease %s was taken over by another replica", key)
                except StoreUnavailable:
                    break
