"""Per-key rate and concurrency quotas: who may start a request now, and what it used.

Identities are owners (``gateway/auth.py``'s ``owner_of``: a hash of the presented API key). Rates are
token buckets in the state store (gateway/state/: O(1) per request, no timestamps kept): a key holds up to a minute's allowance and
regains it continuously, so a burst of a whole minute's requests is admitted and then one more each
60 / limit seconds. Tokens are charged after the fact (a request's size is known only when it
ends), so a key's token bucket may go into debt; it is admitted again once the debt is repaid.
With no rate or concurrency quota configured for anyone, admission is skipped altogether: the
proxied OpenAI path is the gateway's hot path.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from contextvars import ContextVar
from typing import AsyncIterator, Callable

from gateway.auth import owner_of
from gateway.config import QuotaLimits, QuotasConfig
from gateway.domain_errors import RateLimited
from gateway.state import MemoryStore, StateStore, StoreUnavailable

log = logging.getLogger("parrot.quotas")

Clock = Callable[[], float]


def rate_limited(message: str, kind: str, retry_after_s: int) -> RateLimited:
    """429 as OpenAI answers it: type "requests" or "tokens", code rate_limit_exceeded, a retry-after."""
    return RateLimited(message, code="rate_limit_exceeded", error_type=kind, retry_after_s=retry_after_s)


class Admission:
    """An admitted request: holds one of its key's concurrent seats until released, and charges its
    key the tokens it used (the engine's reported usage, else the request's estimate)."""

    __slots__ = ("_quotas", "_owner", "_limits", "_estimate", "_seated", "tokens", "_released")

    def __init__(self, quotas: "Quotas", owner: str, limits: QuotaLimits, estimate_tokens: int, seated: bool):
        self._quotas = quotas
        self._owner = owner
        self._limits = limits
        self._estimate = estimate_tokens
        self._seated = seated
        self.tokens = 0
        self._released = False

    @property
    def metered(self) -> bool:
        return self._limits.tokens_per_minute is not None

    def count(self, tokens: int) -> None:
        """Charges ``tokens`` to the key (in the background: the usage decoder does not wait on the store)."""
        self.tokens += tokens
        if self.metered:
            self._quotas.charge_soon(self._owner, self._limits, tokens)

    def release_soon(self) -> None:
        """``release`` from code that cannot await (a task's done callback): in the background."""
        if not self._released:
            self._quotas.in_background(self.release())

    async def release(self) -> None:
        if self._released:
            return
        self._released = True
        if self._seated:
            await self._quotas.unseat(self._owner)
        if self.tokens == 0 and self._estimate and self.metered:  # no usage reported (no include_usage, a failure)
            self.tokens = self._estimate
            await self._quotas.charge(self._owner, self._limits, self._estimate)


# The admission of the request being served, for the usage decoder (gateway/outcomes.py) to charge;
# set only when its key has a tokens-per-minute quota. Tasks a request starts (semantic calls) inherit it.
_current: ContextVar[Admission | None] = ContextVar("parrot_admission", default=None)


def count_tokens(tokens: int) -> None:
    """Charges ``tokens`` to the key of the request being served, if its key has a token quota."""
    admission = _current.get()
    if admission is not None:
        admission.count(tokens)


class Quotas:
    """Admission under each key's rate buckets and concurrency seats, counted in the state store: with a shared
    one (Redis) every replica counts in the same buckets, each admission one atomic script; with one process's
    store (memory, SQLite) in this process's memory, exact for a single gateway."""

    def __init__(self, config: QuotasConfig, store: StateStore | None = None, *, clock: Clock = time.monotonic,
                 seat_ttl_s: float = 900.0):
        if store is None or not store.shared:
            store = getattr(store, "counters", None) or MemoryStore(clock)
        self._counters: StateStore = store
        self._seat_ttl_s = seat_ttl_s
        self._default = config.for_key(None)
        self._by_owner = {owner_of(key): config.for_key(key) for key in config.keys}
        self._charges: set[asyncio.Task[None]] = set()
        # Whether requests need admitting at all: some key has a rate or concurrency quota.
        self.enabled = any(_limits_rates(limits) for limits in (self._default, *self._by_owner.values()))

    def limits(self, owner: str) -> QuotaLimits:
        return self._by_owner.get(owner, self._default)

    async def admit(self, owner: str, estimate_tokens: int = 0) -> Admission:
        """Admits a request of ``owner`` now or raises a 429 with a retry-after (a 503 when the store is away)."""
        limits = self.limits(owner)
        counters = self._counters
        seated = False
        if limits.concurrent_requests is not None:
            if not await counters.seat(f"seats:{owner}", limits.concurrent_requests, self._seat_ttl_s):
                raise rate_limited(f"Rate limit reached: {limits.concurrent_requests} concurrent requests for this "
                                   "API key. Try again when one of them has finished.", "requests", 1)
            seated = True
        try:
            # Tokens are charged after the answer: admission only needs the bucket out of debt (takes 0, needs 1).
            await self._take_per_minute(f"tpm:{owner}", limits.tokens_per_minute, 0, "tokens", "TPM")
            await self._take_per_minute(f"rpm:{owner}", limits.requests_per_minute, 1, "requests", "RPM")
        except BaseException:
            if seated:
                await self.unseat(owner)
            raise
        return Admission(self, owner, limits, estimate_tokens, seated)

    async def _take_per_minute(self, key: str, per_minute: int | None, amount: int, unit: str, name: str) -> None:
        """Takes ``amount`` from the bucket ``key`` refilled at ``per_minute`` (None: unlimited), which must hold
        1 at least; else a 429 saying when it will."""
        if per_minute is None:
            return
        ok, level = await self._counters.take(key, per_minute, per_minute / 60, amount, 1)
        if not ok:
            wait = _seconds_until(level, 1, per_minute)
            raise rate_limited(f"Rate limit reached on {unit} per min ({name}): limit {per_minute}. "
                               f"Please try again in {wait}s.", unit, wait)

    async def unseat(self, owner: str) -> None:
        try:
            await self._counters.unseat(f"seats:{owner}")
        except StoreUnavailable:  # the seat is forgotten with its count's TTL
            log.warning("a concurrency seat could not be given back: the state store is unavailable")

    async def charge(self, owner: str, limits: QuotaLimits, tokens: int) -> None:
        """Takes ``tokens`` from the key's token bucket, into debt if need be."""
        per_minute = limits.tokens_per_minute
        if per_minute is None or not tokens:
            return
        try:
            await self._counters.take(f"tpm:{owner}", per_minute, per_minute / 60, tokens, float("-inf"))
        except StoreUnavailable:
            log.warning("%d tokens could not be charged: the state store is unavailable", tokens)

    def in_background(self, work) -> None:
        task = asyncio.get_running_loop().create_task(work)
        self._charges.add(task)
        task.add_done_callback(self._charges.discard)

    def charge_soon(self, owner: str, limits: QuotaLimits, tokens: int) -> None:
        if isinstance(self._counters, MemoryStore):  # this process's: charged at once
            per_minute = limits.tokens_per_minute
            assert per_minute is not None
            self._counters.take_now(f"tpm:{owner}", per_minute, per_minute / 60, tokens, float("-inf"))
            return
        self.in_background(self.charge(owner, limits, tokens))

    @contextlib.asynccontextmanager
    async def admitted(self, owner: str, estimate_tokens: int = 0) -> AsyncIterator[Admission | None]:
        """The block runs as an admitted request of ``owner`` (a 429 instead when over quota): its
        concurrency seat is held, and usage the gateway decodes meanwhile is charged to the key."""
        if not self.enabled:
            yield None
            return
        async with self.holding(await self.admit(owner, estimate_tokens)) as admission:
            yield admission

    async def admitted_later(self, owner: str, estimate_tokens: int = 0) -> Admission | None:
        """An admission now (a 429 now when over quota) for work that runs later under ``holding``
        (a background response); None when no quota is configured."""
        return await self.admit(owner, estimate_tokens) if self.enabled else None

    @contextlib.asynccontextmanager
    async def holding(self, admission: Admission | None) -> AsyncIterator[Admission | None]:
        """The block runs as ``admission``'s request: usage decoded meanwhile is charged to its key, and
        its seat is released at the end."""
        if admission is None:
            yield None
            return
        metered = _current.set(admission if admission.metered else None)
        try:
            yield admission
        finally:
            _current.reset(metered)
            await admission.release()

    def forget_idle(self) -> int:
        """Drops the counters of keys that are back to a clean slate (many keys may pass through an open
        gateway); returns how many. A shared store's expire by their TTLs."""
        forget = getattr(self._counters, "forget_full", None)
        return forget() if forget is not None else 0


def _seconds_until(level: float, needed: float, per_minute: int) -> int:
    """Whole seconds (as a retry-after header gives them) until a bucket at ``level`` holds ``needed``."""
    if per_minute <= 0:
        return 60
    return max(1, math.ceil((needed - level) / (per_minute / 60)))


def _limits_rates(limits: QuotaLimits) -> bool:
    return any(value is not None for value in
               (limits.requests_per_minute, limits.tokens_per_minute, limits.concurrent_requests))
