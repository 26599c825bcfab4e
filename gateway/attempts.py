"""One request's way through the engines: where each attempt goes, how long to wait before it, and
when to give up (retries with backoff, the engine's retry-after, fallback models, an overall deadline).

Only requests of which nothing reached the client are retried: non-streamed ones, streams before
their first chunk. A retry goes to another healthy engine of the model when there is one, else to
the same one after a backoff; when the model's attempts are spent, its fallback models follow.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from typing import Any, Awaitable, Callable, Sequence

from engines.seam import EngineError
from gateway.config import RoutingConfig
from gateway.registry import EngineRecord, EngineRegistry
from gateway.scheduler import Scheduler, Work

logger = logging.getLogger(__name__)


def retryable(exc: EngineError) -> bool:
    """Whether another attempt may succeed where this one failed: the engine was unreachable, timed
    out, asked for a pause (408, 429) or failed (5xx). Any other 4xx is the request's own fault."""
    return exc.status_code >= 500 or exc.status_code in (408, 429)


class Attempts:
    """Used as ``while (attempt := await attempts.next()) is not None``, reporting each failure to
    ``failed``, each success to the engine's breaker."""

    __slots__ = ("_registry", "_scheduler", "_describe", "_usable", "_placed", "_work", "_routing", "_models", "_at",
                 "_body", "_tries", "_tried", "_skipped", "_waits", "_deadline", "last_error")

    def __init__(self, registry: EngineRegistry, scheduler: Scheduler, routing: RoutingConfig, model: str,
                 body: dict[str, Any], describe: Callable[[Sequence[EngineRecord]], Awaitable[Work]],
                 usable: Callable[[EngineRecord], bool] | None = None,
                 placed: Callable[[Work, EngineRecord], None] = lambda work, record: None):
        """``describe(engines)``: the request as the scheduler sees it, made when there is a choice among
        ``engines`` to make; ``usable``: which of a model's engines can serve it (None: all); ``placed``: told
        where the scheduler put it."""
        self._registry = registry
        self._scheduler = scheduler
        self._describe = describe
        self._usable = usable
        self._placed = placed
        self._work: Work | None = None
        self._routing = routing
        self._models = [model, *routing.fallbacks[model]] if model in routing.fallbacks else [model]
        self._at = 0  # the model tried now: an index into _models
        self._body = body
        self._tries = 0  # on this model
        self._tried: dict[str, EngineError | None] = {}  # engines of this model tried: their last error
        self._skipped: set[str] = set()  # engines that asked for a longer pause than we wait
        self._waits = 0  # backoffs so far: each doubles
        self._deadline = time.monotonic() + routing.retry_deadline_s  # no retry starts after it
        self.last_error: EngineError | None = None

    async def next(self) -> tuple[EngineRecord, dict[str, Any]] | None:
        """The engine for the next attempt and the body to send it (after waiting its backoff);
        None when none is left, the retries are spent or the deadline passed."""
        while self._at < len(self._models):
            record = await self._choose() if self._tries <= self._routing.num_retries else None
            if record is None:
                self._next_model()
                continue
            if self.last_error is not None and not await self._waited(record):
                return None
            self._tries += 1
            self._tried.setdefault(record.id, None)
            record.breaker.attempt()
            body = self._body if self._at == 0 else {**self._body, "model": self._models[self._at]}
            return record, body
        return None

    def failed(self, record: EngineRecord, exc: EngineError) -> bool:
        """Records a failed attempt; whether to try again (else the error is the answer)."""
        if not retryable(exc):
            record.breaker.succeeded()  # it answered: the request was at fault, not the engine
            return False
        if exc.status_code != 429:  # a 429 says it is up but busy: its retry-after is honoured instead
            record.breaker.failed()
        self.last_error = exc
        self._tried[record.id] = exc
        if exc.retry_after_s is not None and exc.retry_after_s > self._routing.retry_max_backoff_s:
            self._skipped.add(record.id)
        logger.warning("attempt %d on engine %r for model %r failed: %s%s", self._tries, record.engine.name,
                       self._models[self._at], exc, f" ({exc.__cause__!r})" if exc.__cause__ else "")
        return True

    async def _choose(self) -> EngineRecord | None:
        """The scheduler's pick among the model's engines this request has not tried yet, else among
        those it tried; on the last model, one whose circuit is open rather than none."""
        records = self._registry.routable(self._models[self._at], last_resort=self._at == len(self._models) - 1)
        if self._usable is not None:
            records = [r for r in records if self._usable(r)]
        usable = [r for r in records if r.id not in self._skipped] if self._skipped else records
        fresh = [r for r in usable if r.id not in self._tried] if self._tried else usable
        choice = fresh or usable
        if len(choice) <= 1:
            return choice[0] if choice else None
        if self._work is None:
            self._work = await self._describe(choice)
        record = self._scheduler.place(self._work, choice)
        if record is not None:
            self._placed(self._work, record)
        return record

    def _next_model(self) -> None:
        self._at += 1
        self._tries = 0
        self._tried = {}
        self._skipped = set()

    async def _waited(self, record: EngineRecord) -> bool:
        """Waits before a retry on ``record``: nothing for an engine this request has not tried, else
        its retry-after or the next backoff. False when that would end past the deadline."""
        now = time.monotonic()
        wait = 0.0
        if record.id in self._tried:
            error = self._tried[record.id]
            wait = error.retry_after_s if error is not None and error.retry_after_s is not None else self._backoff()
        if now + wait > self._deadline:
            return False
        if wait > 0:
            await asyncio.sleep(wait)
        return True

    def _backoff(self) -> float:
        """Exponential, capped, with jitter (half to all of it), so that clients failed together do
        not come back together."""
        ceiling = min(self._routing.retry_max_backoff_s, self._routing.retry_backoff_s * 2 ** self._waits)
        self._waits += 1
        return ceiling * (0.5 + random.random() / 2)
