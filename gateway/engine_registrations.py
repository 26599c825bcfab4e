"""Engine registrations in the state store: an engine that registered with one gateway replica is known to every
replica sharing the store (Redis), and to this gateway after a restart (SQLite), with the same id and token, so its
heartbeats are taken wherever they land and its requests placed from every replica.

Records:
    engine:{id}   r: the registration (Registration), with a TTL of the heartbeat timeout, renewed by each heartbeat
                  (on whichever replica it lands): an engine that stops heartbeating expires everywhere
    engines       {id: ""}: the registered engines
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec

from engines.seam.connect import connect
from gateway.registry import EngineRecord
from gateway.service import Gateway
from gateway.state import StateStore, StoreUnavailable, every

log = logging.getLogger("parrot.gateway")
INDEX = "engines"


class Registration(msgspec.Struct):
    name: str
    url: str
    models: list[str]
    capabilities: list[str]
    token: str  # the engine's credential for its heartbeats
    secret: str  # what the gateway presents to the engine (the engine secret it registered with)


_encode = msgspec.json.Encoder().encode
_registration = msgspec.json.Decoder(Registration).decode


def engine_key(engine_id: str) -> str:
    return f"engine:{engine_id}"


class SharedRegistrations:
    def __init__(self, store: StateStore, gateway: Gateway) -> None:
        self.store = store if store.shared or store.durable else None  # memory: this process's registry alone
        self.gateway = gateway
        self.ttl_s = gateway.registry.heartbeat_timeout_s
        self._adopted: set[str] = set()  # engines registered elsewhere (another replica, an earlier process)
        self._task: asyncio.Task[None] | None = None

    async def registered(self, record: EngineRecord, capabilities: list[str], secret: str) -> None:
        if self.store is None or record.url is None or record.token is None:
            return
        registration = Registration(record.engine.name, record.url, record.models, capabilities, record.token, secret)
        await self.store.apply([("write", engine_key(record.id), {"r": _encode(registration)}, self.ttl_s),
                                ("write", INDEX, {record.id: b""}, None)])

    async def heartbeat(self, engine_id: str) -> None:
        if self.store is not None:
            try:
                await self.store.expire(engine_key(engine_id), self.ttl_s)
            except StoreUnavailable:
                pass  # the engine's heartbeat is taken here all the same

    async def removed(self, engine_id: str) -> None:
        if self.store is not None:
            await self.store.apply([("remove", [engine_key(engine_id)]), ("remove_fields", INDEX, [engine_id])])

    def start(self) -> None:
        if self.store is not None:
            self._task = asyncio.get_running_loop().create_task(
                every(min(1.0, self.ttl_s / 4), self.sync, "reading engine registrations"), name="engine-registrations")

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def sync(self) -> None:
        """Engines registered elsewhere are adopted; those whose registration expired or was removed are let go;
        the adopted ones alive in the store count as heartbeating here."""
        assert self.store is not None
        registry = self.gateway.registry
        listed = await self.store.read(INDEX)
        for engine_id in listed:
            raw = await self.store.read_field(engine_key(engine_id), "r")
            record = registry.get(engine_id)
            if raw is None:
                await self.store.remove_fields(INDEX, [engine_id])
                if record is not None and engine_id in self._adopted:
                    registry.remove(engine_id)
                continue
            if record is not None:
                if engine_id in self._adopted:
                    record.last_heartbeat = time.monotonic()  # its heartbeats land on another replica
                continue
            self._adopt(engine_id, _registration(raw))
        for engine_id in [e for e in self._adopted if e not in listed]:
            registry.remove(engine_id)
        self._adopted = {e for e in self._adopted if registry.get(e) is not None}

    def _adopt(self, engine_id: str, registration: Registration) -> None:
        gateway = self.gateway
        engine = connect(registration.name, registration.url, gateway.client, capabilities=registration.capabilities,
                         api_key=registration.secret, transport=gateway.transport)
        gateway.registry.adopt(engine_id, engine, registration.models, url=registration.url, token=registration.token)
        self._adopted.add(engine_id)
        log.info("engine %s (%s) registered elsewhere: adopted", engine_id, registration.url)
