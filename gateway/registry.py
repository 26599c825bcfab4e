"""Which engines serve which model, which of them are healthy, and which one takes the next request."""

from __future__ import annotations

import asyncio
import ipaddress
import secrets
import socket
import time
from typing import Any, Callable, Iterable, Iterator

import httpx
import msgspec

from engines.seam import Engine, EngineStats
from gateway.circuit import CircuitBreaker
from gateway.engine_view import EngineView
from gateway.request_rate import RequestRate


class EngineConflict(Exception):
    """A live engine is registered at that URL already: a newcomer may not take its place."""


def url_key(url: str) -> tuple[str, str, int, str]:
    """One spelling per engine address: scheme and host lower-cased, the default port explicit, no
    trailing ``/`` or ``/v1`` (static upstreams are configured with it, registered engines without)."""
    try:
        parsed = httpx.URL(url)
    except httpx.InvalidURL as exc:
        raise ValueError(f"{url!r} is not a valid URL: {exc}") from exc
    if parsed.scheme not in ("http", "https") or not parsed.host:
        raise ValueError(f"{url!r} is not an http:// or https:// URL")
    port = parsed.port or (443 if parsed.scheme == "https" else 80)
    return parsed.scheme, parsed.host.lower(), port, parsed.path.rstrip("/").removesuffix("/v1")


# Every address of this host as one: an engine listening on 0.0.0.0 is reached as localhost, 127.1, ::1 or
# the host's own interface addresses alike.
THIS_HOST = "this-host"
Endpoint = tuple[str, int, str]  # an address (or THIS_HOST), a port, a path


async def endpoints_of(url: str) -> frozenset[Endpoint]:
    """Where ``url`` leads: each address its host resolves to, with port and path; two URLs that share one
    reach the same listener however their hosts are spelled. A host that does not resolve (yet) stands
    for itself. ValueError for a malformed URL."""
    _, host, port, path = url_key(url)
    loop = asyncio.get_running_loop()
    try:
        infos = await loop.getaddrinfo(host.strip("[]"), port, type=socket.SOCK_STREAM)
    except (OSError, UnicodeError):
        return frozenset({(host, port, path)})
    own = await _own_addresses()
    return frozenset((_collapsed(info[4][0], own), port, path) for info in infos)


def _collapsed(address: str, own: frozenset[str]) -> str:
    ip = ipaddress.ip_address(address.split("%", 1)[0])  # an IPv6 scope id aside
    if ip.is_loopback or ip.is_unspecified or str(ip) in own:
        return THIS_HOST
    return str(ip)


_own: frozenset[str] | None = None


async def _own_addresses() -> frozenset[str]:
    """This host's own interface addresses (as its name resolves), looked up once."""
    global _own
    if _own is None:
        try:
            infos = await asyncio.get_running_loop().getaddrinfo(socket.gethostname(), None)
            _own = frozenset(str(ipaddress.ip_address(info[4][0].split("%", 1)[0])) for info in infos)
        except (OSError, ValueError):
            _own = frozenset()
    return _own


def _key_or_none(url: str) -> tuple[str, str, int, str] | None:
    try:
        return url_key(url)
    except ValueError:  # a configured upstream's URL, which no registration can match
        return None


class EngineRecord(EngineView, kw_only=True):
    """An engine as the gateway holds it: the scheduler's view of it, the engine itself, its health."""

    engine: Engine
    url: str | None = None
    breaker: CircuitBreaker = msgspec.field(default_factory=CircuitBreaker)  # fed by requests and health checks
    last_heartbeat: float | None = None  # None: not heartbeating (static upstreams)
    token: str | None = None  # a registered engine's proof of identity for heartbeats (never listed)
    endpoints: frozenset[Endpoint] = frozenset()  # where its URL leads (endpoints_of), for registered ones
    requests: RequestRate = msgspec.field(default_factory=RequestRate)  # requests sent to it (the dashboard's req/s)
    latency_in_flight: int = 0  # of in_flight, latency-critical requests on an engine without criteria (admission)
    stats_at: float = 0.0  # when ``stats`` was read (time.monotonic(): a heartbeat, a health check, a refresh)
    refreshing: Any = None  # the task asking the engine for its stats now, if one is (fresh_stats)

    def report(self, stats: EngineStats) -> None:
        self.stats, self.stats_at = stats, time.monotonic()

    async def fresh_stats(self, max_age_s: float) -> EngineStats:
        """Its stats, read no longer than ``max_age_s`` ago: asked of the engine when older (one request at a time,
        however many wait for it); the last reading when the engine cannot say."""
        if time.monotonic() - self.stats_at <= max_age_s:
            return self.stats
        if self.refreshing is None or self.refreshing.done():
            self.refreshing = asyncio.ensure_future(self._refresh())
        await asyncio.shield(self.refreshing)
        return self.stats

    async def _refresh(self) -> None:
        try:
            self.report(await self.engine.stats())
        except Exception:  # unreachable or unreadable: its last reading stands, until the next try
            self.stats_at = time.monotonic()

    def healthy(self, now: float, heartbeat_timeout_s: float) -> bool:
        return self.breaker.allows() and not self.expired(now, heartbeat_timeout_s)

    def expired(self, now: float, heartbeat_timeout_s: float) -> bool:
        return self.last_heartbeat is not None and now - self.last_heartbeat > heartbeat_timeout_s


class EngineRegistry:
    def __init__(self, heartbeat_timeout_s: float = 10.0, registration_secrets: Iterable[str | None] = (),
                 new_breaker: Callable[[], CircuitBreaker] = CircuitBreaker):
        self._new_breaker = new_breaker  # each engine's own, with the configured thresholds
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._records: dict[str, EngineRecord] = {}
        self._secrets = [s.encode() for s in registration_secrets if s]  # what registering engines present
        self._configured = bool(self._secrets)  # a [engines] registration_secret, for remote engines
        self._expected: set[str] = set()  # models of engines being started (not registered yet)
        self._on_removed: list[Callable[[str], None]] = []

    def on_removed(self, forget: Callable[[str], None]) -> None:
        """``forget(engine_id)`` is called for every engine removed, however (the scheduler's memory of it)."""
        self._on_removed.append(forget)

    def _removed(self, record: EngineRecord) -> None:
        del self._records[record.id]
        for forget in self._on_removed:
            forget(record.id)

    # ------------------------------------------------------------ engine trust

    def allow_secret(self, secret: str) -> None:
        self._secrets.append(secret.encode())

    def registration_open(self) -> bool:
        """Whether remote engines may register (a secret is configured); the engines the gateway starts
        register with secrets of their own (``allow_secret``), which open it to nobody else."""
        return self._configured

    def secret_accepted(self, presented: str) -> bool:
        presented_bytes = presented.encode()
        # Every secret compared, in constant time: the answer's timing tells nothing.
        return sum(secrets.compare_digest(presented_bytes, s) for s in self._secrets) > 0

    def register(self, engine: Engine, models: list[str], *, url: str,
                 endpoints: frozenset[Endpoint] = frozenset()) -> EngineRecord:
        """A heartbeating engine announcing itself; it gets a token of its own for its heartbeats.
        Raises EngineConflict when a live engine holds that URL, however spelled: the same text, or a
        host that resolves to the same address (``endpoints``, from endpoints_of). ValueError for a
        malformed URL."""
        key = url_key(url)
        self.prune()
        if self._at(key) or any(r.endpoints & endpoints for r in self._records.values()):
            raise EngineConflict(f"an engine is registered at {url} already")
        record = self.add(engine, models, url=url, heartbeating=True)
        record.token = secrets.token_urlsafe(32)
        record.endpoints = endpoints
        return record

    def authenticated(self, engine_id: str, token: str) -> EngineRecord | None:
        """The record ``token`` proves to be ``engine_id``'s, else None (also once it expired)."""
        self.prune()
        record = self._records.get(engine_id)
        if record is None or record.token is None or not secrets.compare_digest(record.token.encode(),
                                                                                 token.encode()):
            return None
        return record

    def remove_url(self, url: str) -> list[EngineRecord]:
        """Removes the engines registered at ``url`` (one known to have died)."""
        gone = self._at(url_key(url))
        for record in gone:
            self._removed(record)
        return gone

    def _at(self, key: tuple[str, str, int, str]) -> list[EngineRecord]:
        return [r for r in self._records.values() if r.url is not None and _key_or_none(r.url) == key]

    def prune(self) -> None:
        """Forgets engines silent past the heartbeat timeout (a restarted one registers again)."""
        now = time.monotonic()
        for record in [r for r in self._records.values() if r.expired(now, self.heartbeat_timeout_s)]:
            self._removed(record)

    def expect(self, models: Iterable[str]) -> None:
        """Models an engine being started will serve: known (503 rather than 404) before it registers."""
        self._expected.update(models)

    def expected_models(self) -> list[str]:
        return sorted(self._expected)

    def add(self, engine: Engine, models: list[str], *, url: str | None = None,
            heartbeating: bool = False) -> EngineRecord:
        record = EngineRecord(
            id=f"eng-{secrets.token_hex(8)}", engine=engine, models=list(models), url=url,
            last_heartbeat=time.monotonic() if heartbeating else None, breaker=self._new_breaker(),
        )
        self._records[record.id] = record
        return record

    def adopt(self, engine_id: str, engine: Engine, models: list[str], *, url: str, token: str) -> EngineRecord:
        """An engine registered with another gateway replica (or an earlier process), under its id and token there."""
        record = EngineRecord(id=engine_id, engine=engine, models=list(models), url=url, token=token,
                              last_heartbeat=time.monotonic(), breaker=self._new_breaker())
        self._records[engine_id] = record
        return record

    def remove(self, engine_id: str) -> EngineRecord | None:
        record = self._records.get(engine_id)
        if record is not None:
            self._removed(record)
        return record

    def get(self, engine_id: str) -> EngineRecord | None:
        return self._records.get(engine_id)

    def records(self) -> list[EngineRecord]:
        self.prune()
        return list(self._records.values())

    def models(self) -> list[str]:
        """The models of the engines registered now."""
        self.prune()
        return sorted({m for r in self._records.values() for m in r.models})

    def serves(self, model: str) -> bool:
        return model in self._expected or any(model in r.models for r in self._records.values())

    def heartbeat(self, engine_id: str, stats: EngineStats) -> bool:
        record = self._records.get(engine_id)
        if record is None or record.last_heartbeat is None:  # static upstreams don't heartbeat
            return False
        record.last_heartbeat = time.monotonic()
        record.report(stats)
        return True

    def candidates(self, model: str) -> Iterator[EngineRecord]:
        """Healthy engines for ``model`` (live, circuit not open)."""
        return iter(self.routable(model))

    def routable(self, model: str, *, last_resort: bool = False) -> list[EngineRecord]:
        """Healthy engines for ``model`` (the scheduler picks among them). With ``last_resort``, when
        every live one's circuit is open: the one open longest, so that a request is tried (as a
        probe) rather than refused unseen."""
        now = time.monotonic()
        healthy = [r for r in self._records.values()
                   if model in r.models and r.healthy(now, self.heartbeat_timeout_s)]
        if healthy or not last_resort:
            return healthy
        live = [r for r in self._records.values()
                if model in r.models and not r.expired(now, self.heartbeat_timeout_s)]
        return [min(live, key=lambda r: r.breaker.opened_at or 0.0)] if live else []

    async def aclose(self) -> None:
        for record in self._records.values():
            await record.engine.aclose()
        self._records.clear()
