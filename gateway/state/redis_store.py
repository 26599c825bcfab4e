"""The state seam on Redis or Valkey (the ``redis`` package's asyncio client): every gateway replica pointed at
the same server shares records, counters and wake-ups.

Counters are Lua scripts, each one atomic on the server and timed by the server's clock (``TIME``), so a
per-key limit holds exactly across replicas whatever their clocks say. Wake-ups are Redis pub/sub: one
subscriber connection per process, reconnected (and resubscribed) when it drops.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisError

from gateway.state.store import Listener, StoreUnavailable, redacted

log = logging.getLogger("parrot.state")
T = TypeVar("T")

# KEYS[1]: the bucket. ARGV: capacity, refill per second, cost, level needed. -> {admitted 0/1, level after}
_TAKE = """
local capacity, per_s, cost, need = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local state = redis.call('HMGET', KEYS[1], 'l', 'u')
local level = tonumber(state[1])
if level == nil then level = capacity else level = math.min(capacity, level + (now - tonumber(state[2])) * per_s) end
local ok = 0
if level >= need then
  level = level - cost
  ok = 1
end
redis.call('HSET', KEYS[1], 'l', string.format('%.17g', level), 'u', string.format('%.17g', now))
local ttl = 3600
if per_s > 0 then ttl = math.ceil((capacity - level) / per_s) + 1 end
redis.call('EXPIRE', KEYS[1], ttl)
return {ok, string.format('%.17g', level)}
"""

# KEYS[1]: the seat count. ARGV: limit (-1: none), TTL seconds. -> 1 seated, 0 full
_SEAT = """
local n = tonumber(redis.call('GET', KEYS[1]) or '0')
local limit = tonumber(ARGV[1])
if limit >= 0 and n >= limit then return 0 end
redis.call('INCR', KEYS[1])
redis.call('EXPIRE', KEYS[1], ARGV[2])
return 1
"""

_UNSEAT = """
local n = redis.call('DECR', KEYS[1])
if n <= 0 then redis.call('DEL', KEYS[1]) end
return n
"""

# KEYS[1]: the record. ARGV: field, value, TTL in ms (0: none). -> the field's value now
_WRITE_NEW = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  if tonumber(ARGV[3]) > 0 then redis.call('PEXPIRE', KEYS[1], ARGV[3]) end
  return ARGV[2]
end
return redis.call('HGET', KEYS[1], ARGV[1])
"""


# KEYS[1]: the lease. ARGV: holder, TTL in ms. -> 1 held by this holder now, 0 held by another
_LEASE = """
local held = redis.call('HGET', KEYS[1], 'holder')
if held and held ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'holder', ARGV[1])
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
"""

# KEYS[1]: the set's members by when each was last counted (a sorted set), KEYS[2]: their sizes (a hash, with the
# total under ' total'). ARGV: member, size, max count, max bytes, TTL in seconds. -> the members dropped
_KEEP = """
local member, size, max_count, max_bytes, ttl = ARGV[1], tonumber(ARGV[2]), tonumber(ARGV[3]), tonumber(ARGV[4]),
  tonumber(ARGV[5])
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local total = tonumber(redis.call('HGET', KEYS[2], ' total') or '0')
local function out(m)
  total = total - tonumber(redis.call('HGET', KEYS[2], m) or '0')
  redis.call('ZREM', KEYS[1], m)
  redis.call('HDEL', KEYS[2], m)
end
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', string.format('%.6f', now - ttl))) do out(m) end
out(member)
redis.call('ZADD', KEYS[1], string.format('%.6f', now), member)
redis.call('HSET', KEYS[2], member, size)
total = total + size
local dropped = {}
while redis.call('ZCARD', KEYS[1]) > max_count or total > max_bytes do
  local oldest = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
  if oldest == member then break end
  out(oldest)
  table.insert(dropped, oldest)
end
redis.call('HSET', KEYS[2], ' total', total)
redis.call('EXPIRE', KEYS[1], math.ceil(ttl) + 1)
redis.call('EXPIRE', KEYS[2], math.ceil(ttl) + 1)
return dropped
"""

# KEYS as _KEEP's. ARGV: the members
_FORGET = """
for _, m in ipairs(ARGV) do
  local size = redis.call('HGET', KEYS[2], m)
  if size then
    redis.call('HINCRBY', KEYS[2], ' total', -tonumber(size))
    redis.call('HDEL', KEYS[2], m)
  end
  redis.call('ZREM', KEYS[1], m)
end
return 0
"""

# The writes of a batch (StateStore.apply), in order, in one script: one command to send and one reply to read
# instead of two per write (the client's work per command is what a batch of a request's writes costs). ARGV: the
# ops one after another: w key ttl_ms(0: none) n field value ... | d key n field ... | x n key ... | e key ttl_ms |
# p channel message | r key field value
_APPLY = """
local function chunked(command, key, from, to)
  for start = from, to, 1000 do
    local stop = math.min(start + 999, to)
    if key then redis.call(command, key, unpack(ARGV, start, stop)) else redis.call(command, unpack(ARGV, start, stop)) end
  end
end
local i, n = 1, #ARGV
while i <= n do
  local op = ARGV[i]
  if op == 'w' then
    local key, ttl, count = ARGV[i + 1], tonumber(ARGV[i + 2]), tonumber(ARGV[i + 3])
    chunked('HSET', key, i + 4, i + 3 + 2 * count)
    if ttl > 0 then redis.call('PEXPIRE', key, ttl) end
    i = i + 4 + 2 * count
  elseif op == 'd' then
    local count = tonumber(ARGV[i + 2])
    chunked('HDEL', ARGV[i + 1], i + 3, i + 2 + count)
    i = i + 3 + count
  elseif op == 'x' then
    local count = tonumber(ARGV[i + 1])
    chunked('DEL', nil, i + 2, i + 1 + count)
    i = i + 2 + count
  elseif op == 'e' then
    redis.call('PEXPIRE', ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'p' then
    redis.call('PUBLISH', ARGV[i + 1], ARGV[i + 2])
    i = i + 3
  elseif op == 'r' then
    if redis.call('HGET', ARGV[i + 1], ARGV[i + 2]) == ARGV[i + 3] then redis.call('DEL', ARGV[i + 1]) end
    i = i + 4
  else
    return redis.error_reply('unknown state operation ' .. tostring(op))
  end
end
return 0
"""


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _unavailable(method: Callable[..., Awaitable[T]]) -> Callable[..., Awaitable[T]]:
    @functools.wraps(method)
    async def wrapper(self: "RedisStore", *args: Any, **kwargs: Any) -> T:
        try:
            return await method(self, *args, **kwargs)
        except (RedisError, OSError, asyncio.TimeoutError) as exc:
            self.errors += 1
            raise StoreUnavailable(f"the gateway's state store (Redis) is unavailable: {type(exc).__name__}: "
                                   f"{exc}") from None
    return wrapper


class RedisStore:
    kind = "redis"
    shared = True
    durable = True  # as the server is configured (RDB / AOF): the gateway's side keeps nothing

    def __init__(self, url: str, *, timeout_s: float = 2.0, prefix: str = "parrot:") -> None:
        if url.startswith("valkey://") or url.startswith("valkeys://"):
            url = "redis" + url[len("valkey"):]
        self.url = url
        self.prefix = prefix
        self.errors = 0  # operations that failed (for /metrics)
        options = dict(socket_connect_timeout=timeout_s, retry=Retry(NoBackoff(), 1), health_check_interval=30)
        self._redis = aioredis.Redis.from_url(url, socket_timeout=timeout_s, **options)
        self._subscriber = aioredis.Redis.from_url(url, **options)  # blocks on reads: no socket timeout
        self._take = self._redis.register_script(_TAKE)
        self._seat = self._redis.register_script(_SEAT)
        self._unseat = self._redis.register_script(_UNSEAT)
        self._write_new = self._redis.register_script(_WRITE_NEW)
        self._lease = self._redis.register_script(_LEASE)
        self._keep = self._redis.register_script(_KEEP)
        self._apply = self._redis.register_script(_APPLY)
        self._forget = self._redis.register_script(_FORGET)
        self._listeners: dict[str, list[Listener]] = {}
        self._pubsub: Any = None
        self._reader: asyncio.Task[None] | None = None
        self._subscribed = asyncio.Event()
        self._reconnected: list[Callable[[], None]] = []

    @property
    def subscribed(self) -> bool:
        """The subscriber connection is up: wake-ups published now reach this process."""
        return self._subscribed.is_set()

    def _key(self, key: str) -> str:
        return self.prefix + key

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_messages(), name="state-pubsub")
        try:  # a gateway may start while its store is down: it serves 503s until it is back
            await asyncio.wait_for(self._subscribed.wait(), 5.0)
        except asyncio.TimeoutError:
            log.warning("the state store at %s is not reachable yet", redacted(self.url))

    async def aclose(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            await asyncio.gather(self._reader, return_exceptions=True)
        if self._pubsub is not None:
            try:
                await self._pubsub.aclose()
            except Exception:
                pass
        await self._subscriber.aclose()
        await self._redis.aclose()

    @_unavailable
    async def ping(self) -> float:
        started = time.perf_counter()
        await self._redis.ping()
        return time.perf_counter() - started

    # ---------------------------------------------------------------- records

    @_unavailable
    async def read(self, key: str) -> dict[str, bytes]:
        return {field.decode(): value for field, value in (await self._redis.hgetall(self._key(key))).items()}

    @_unavailable
    async def read_field(self, key: str, field: str) -> bytes | None:
        return await self._redis.hget(self._key(key), field)

    @_unavailable
    async def write(self, key: str, fields: dict[str, bytes], ttl_s: float | None = None) -> None:
        if ttl_s is None:
            await self._redis.hset(self._key(key), mapping=fields)
            return
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key(key), mapping=fields)
            pipe.pexpire(self._key(key), max(1, int(ttl_s * 1000)))
            await pipe.execute()

    @_unavailable
    async def write_new(self, key: str, field: str, value: bytes, ttl_s: float | None = None) -> bytes:
        ttl_ms = max(1, int(ttl_s * 1000)) if ttl_s is not None else 0
        return await self._write_new(keys=[self._key(key)], args=[field, value, ttl_ms])

    @_unavailable
    async def remove_fields(self, key: str, fields: list[str]) -> None:
        if fields:
            await self._redis.hdel(self._key(key), *fields)

    @_unavailable
    async def remove(self, keys: list[str]) -> None:
        if keys:
            await self._redis.delete(*(self._key(k) for k in keys))

    @_unavailable
    async def expire(self, key: str, ttl_s: float) -> None:
        await self._redis.pexpire(self._key(key), max(1, int(ttl_s * 1000)))

    @_unavailable
    async def apply(self, ops: list[tuple]) -> None:
        """One script (one round trip): the writes in order, atomically as it happens (a script runs alone)."""
        args: list[Any] = []
        for op in ops:
            kind = op[0]
            if kind == "write":
                args += ["w", self._key(op[1]), _ms(op[3]) if op[3] is not None else 0, len(op[2])]
                for field, value in op[2].items():
                    args += [field, value]
            elif kind == "remove_fields":
                args += ["d", self._key(op[1]), len(op[2]), *op[2]]
            elif kind == "remove":
                args += ["x", len(op[1]), *(self._key(k) for k in op[1])]
            elif kind == "expire":
                args += ["e", self._key(op[1]), _ms(op[2])]
            elif kind == "publish":
                args += ["p", self._key(op[1]), op[2]]
            elif kind == "remove_if":
                args += ["r", self._key(op[1]), op[2], op[3]]
            else:
                raise ValueError(f"unknown state operation {kind!r}")
        if args:
            await self._apply(keys=[], args=args)

    @_unavailable
    async def lease(self, key: str, holder: str, ttl_s: float) -> bool:
        return bool(await self._lease(keys=[self._key(key)], args=[holder, max(1, int(ttl_s * 1000))]))

    # ---------------------------------------------------------------- counters

    @_unavailable
    async def take(self, key: str, capacity: float, per_s: float, cost: float, need: float) -> tuple[bool, float]:
        ok, level = await self._take(keys=[self._key(key)], args=[repr(float(capacity)), repr(float(per_s)),
                                                                   repr(float(cost)), repr(float(need))])
        return bool(ok), float(level)

    @_unavailable
    async def seat(self, key: str, limit: int | None, ttl_s: float) -> bool:
        return bool(await self._seat(keys=[self._key(key)], args=[-1 if limit is None else limit,
                                                                   max(1, int(ttl_s))]))

    @_unavailable
    async def unseat(self, key: str) -> None:
        await self._unseat(keys=[self._key(key)])

    def forget_full(self) -> int:
        return 0  # the server's TTLs do it

    # ---------------------------------------------------------------- bounded sets

    def _set_keys(self, key: str) -> list[str]:
        return [self._key(key), self._key(f"{key}:sizes")]

    @_unavailable
    async def keep(self, key: str, member: str, size: int, max_count: int, max_bytes: int,
                   ttl_s: float) -> list[str]:
        dropped = await self._keep(keys=self._set_keys(key), args=[member, size, max_count, max_bytes, repr(ttl_s)])
        return [m.decode() for m in dropped]

    @_unavailable
    async def forget(self, key: str, members: list[str]) -> None:
        if members:
            await self._forget(keys=self._set_keys(key), args=members)

    # ---------------------------------------------------------------- wake-ups

    @_unavailable
    async def publish(self, channel: str, message: bytes) -> None:
        await self._redis.publish(self._key(channel), message)

    def subscribe(self, channel: str, listener: Listener) -> None:
        self._listeners.setdefault(self._key(channel), []).append(listener)
        if self._pubsub is not None and self._subscribed.is_set():
            asyncio.get_running_loop().create_task(self._pubsub.subscribe(self._key(channel)))

    async def _read_messages(self) -> None:
        """The one subscriber connection: (re)connects and (re)subscribes, then hands each message to its
        channel's listeners; while the server is away it retries every half second."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                self._pubsub = self._subscriber.pubsub(ignore_subscribe_messages=True)
                await self._pubsub.subscribe(*(self._listeners or [self._key("_")]))
                self._subscribed.set()
                for listener in self._reconnected:
                    loop.call_soon(listener)
                while True:
                    message = await self._pubsub.get_message(timeout=5.0)
                    if message is not None and message["type"] == "message":
                        channel = message["channel"].decode()
                        for listener in self._listeners.get(channel, ()):
                            listener(message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the server went away: resubscribe once it is back
                self._subscribed.clear()
                log.warning("state store subscription lost (%s); reconnecting", exc)
                try:
                    await self._pubsub.aclose()
                except Exception:
                    pass
                await asyncio.sleep(0.5)

    def on_subscribed(self, callback: Callable[[], None]) -> None:
        """``callback()`` each time the subscription is (re)established: wake-ups may have been missed meanwhile."""
        self._reconnected.append(callback)

