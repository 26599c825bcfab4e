"""Per-key rate and concurrency quotas: who may start a request now, and what it used.

Identities are owners (``gateway/auth.py``'s ``owner_of``: a hash of the presented API key). Rates are
token buckets (O(1) per request, no timestamps kept): a key holds up to a minute's allowance and
regains it continuously, so a burst of a whole minute's requests is admitted and then one more each
60 / limit seconds. Tokens are charged after the fact (a request's size is known only when it
ends), so a key's token bucket may go into debt; it is admitted again once the debt is repaid.
With no rate or concurrency quota configured for anyone, admission is skipped altogether: the
proxied OpenAI path is the gateway's hot path.
"""

from __future__ import annotations

import contextlib
import math
import time
from contextvars import ContextVar
from typing import Callable, Iterator

from gateway.auth import owner_of
from gateway.config import QuotaLimits, QuotasConfig
from gateway.domain_errors import RateLimited

Clock = Callable[[], float]


class TokenBucket:
    """Holds up to ``per_minute`` units, refilled at ``per_minute / 60`` a second; may go into debt."""

    __slots__ = ("capacity", "rate", "level", "updated")

    def __init__(self, per_minute: int, now: float):
        self.capacity = float(per_minute)
        self.rate = per_minute / 60.0
        self.level = self.capacity
        self.updated = now

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.updated) * self.rate)
        self.updated = now
        return self.level

    def seconds_until(self, level: float) -> int:
        """Whole seconds (as a retry-after header gives them) until the bucket holds ``level``."""
        if self.rate <= 0:
            return 60
        return max(1, math.ceil((level - self.level) / self.rate))

    def full(self, now: float) -> bool:
        return self.refill(now) >= self.capacity


def rate_limited(message: str, kind: str, retry_after_s: int) -> RateLimited:
    """429 as OpenAI answers it: type "requests" or "tokens", code rate_limit_exceeded, a retry-after."""
    return RateLimited(message, code="rate_limit_exceeded", error_type=kind, retry_after_s=retry_after_s)


class KeyUsage:
    """One key's rate buckets and its requests in flight."""

    __slots__ = ("limits", "requests", "tokens", "open_requests")

    def __init__(self, limits: QuotaLimits, now: float):
        self.limits = limits
        self.requests = TokenBucket(limits.requests_per_minute, now) if limits.requests_per_minute is not None else None
        self.tokens = TokenBucket(limits.tokens_per_minute, now) if limits.tokens_per_minute is not None else None
        self.open_requests = 0

    def idle(self, now: float) -> bool:
        """Nothing in flight and every bucket full: forgetting it changes nothing."""
        return (self.open_requests == 0 and (self.requests is None or self.requests.full(now))
                and (self.tokens is None or self.tokens.full(now)))


class Admission:
    """An admitted request: holds one of its key's concurrent seats until released, and charges its
    key the tokens it used (the engine's reported usage, else the request's estimate)."""

    __slots__ = ("_usage", "_clock", "_estimate", "tokens", "_released")

    def __init__(self, usage: KeyUsage, clock: Clock, estimate_tokens: int):
        self._usage = usage
        self._clock = clock
        self._estimate = estimate_tokens
        self.tokens = 0
        self._released = False

    def count(self, tokens: int) -> None:
        self.tokens += tokens
        if self._usage.tokens is not None:
            self._usage.tokens.refill(self._clock())
            self._usage.tokens.level -= tokens

    def release(self) -> None:
        if self._released:
            return
        self._released = True
        self._usage.open_requests -= 1
        if self.tokens == 0 and self._estimate:  # no usage reported (a stream without include_usage, a failure)
            self.count(self._estimate)


# The admission of the request being served, for the usage decoder (gateway/outcomes.py) to charge;
# set only when its key has a tokens-per-minute quota. Tasks a request starts (semantic calls) inherit it.
_current: ContextVar[Admission | None] = ContextVar("parrot_admission", default=None)


def count_tokens(tokens: int) -> None:
    """Charges ``tokens`` to the key of the request being served, if its key has a token quota."""
    admission = _current.get()
    if admission is not None:
        admission.count(tokens)


class Quotas:
    def __init__(self, config: QuotasConfig, clock: Clock = time.monotonic):
        self._clock = clock
        self._default = config.for_key(None)
        self._by_owner = {owner_of(key): config.for_key(key) for key in config.keys}
        self._usage: dict[str, KeyUsage] = {}
        # Whether requests need admitting at all: some key has a rate or concurrency quota.
        self.enabled = any(_limits_rates(limits) for limits in (self._default, *self._by_owner.values()))

    def limits(self, owner: str) -> QuotaLimits:
        return self._by_owner.get(owner, self._default)

    def admit(self, owner: str, estimate_tokens: int = 0) -> Admission:
        """Admits a request of ``owner`` now or raises a 429 with a retry-after."""
        now = self._clock()
        usage = self._usage.get(owner)
        if usage is None:
            usage = self._usage[owner] = KeyUsage(self.limits(owner), now)
        limits = usage.limits
        if limits.concurrent_requests is not None and usage.open_requests >= limits.concurrent_requests:
            raise rate_limited(f"Rate limit reached: {limits.concurrent_requests} concurrent requests for this "
                               "API key. Try again when one of them has finished.", "requests", 1)
        if usage.tokens is not None and usage.tokens.refill(now) < 1:
            raise rate_limited(f"Rate limit reached on tokens per min (TPM): limit {limits.tokens_per_minute}. "
                               f"Please try again in {usage.tokens.seconds_until(1)}s.", "tokens",
                               usage.tokens.seconds_until(1))
        if usage.requests is not None:
            if usage.requests.refill(now) < 1:
                wait = usage.requests.seconds_until(1)
                raise rate_limited(f"Rate limit reached on requests per min (RPM): limit "
                                   f"{limits.requests_per_minute}. Please try again in {wait}s.", "requests", wait)
            usage.requests.level -= 1
        usage.open_requests += 1
        return Admission(usage, self._clock, estimate_tokens)

    @contextlib.contextmanager
    def admitted(self, owner: str, estimate_tokens: int = 0) -> Iterator[Admission | None]:
        """The block runs as an admitted request of ``owner`` (a 429 instead when over quota): its
        concurrency seat is held, and usage the gateway decodes meanwhile is charged to the key."""
        if not self.enabled:
            yield None
            return
        with self.holding(self.admit(owner, estimate_tokens)) as admission:
            yield admission

    def admitted_later(self, owner: str, estimate_tokens: int = 0) -> Admission | None:
        """An admission now (a 429 now when over quota) for work that runs later under ``holding``
        (a background response); None when no quota is configured."""
        return self.admit(owner, estimate_tokens) if self.enabled else None

    @contextlib.contextmanager
    def holding(self, admission: Admission | None) -> Iterator[Admission | None]:
        """The block runs as ``admission``'s request: usage decoded meanwhile is charged to its key, and
        its seat is released at the end."""
        if admission is None:
            yield None
            return
        metered = _current.set(admission if admission._usage.tokens is not None else None)
        try:
            yield admission
        finally:
            _current.reset(metered)
            admission.release()

    def forget_idle(self) -> int:
        """Drops the state of keys that are back to a clean slate (many keys may pass through an open
        gateway); returns how many."""
        now = self._clock()
        idle = [owner for owner, usage in self._usage.items() if usage.idle(now)]
        for owner in idle:
            del self._usage[owner]
        return len(idle)


def _limits_rates(limits: QuotaLimits) -> bool:
    return any(value is not None for value in
               (limits.requests_per_minute, limits.tokens_per_minute, limits.concurrent_requests))
