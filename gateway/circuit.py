"""A per-engine circuit breaker: after repeated failures an engine gets a rest instead of more requests.

closed: requests flow. After ``failure_threshold`` consecutive failures (or one failed health check)
it is open: no requests for ``cooldown_s``. Then half-open: exactly one request, the probe, is let
through per cool-down; its success closes the breaker, its failure opens it for another cool-down.
"""

from __future__ import annotations

import time
from typing import Callable, Literal

State = Literal["closed", "open", "half_open"]


class CircuitBreaker:
    __slots__ = ("failure_threshold", "cooldown_s", "_clock", "_failures", "_opened_at", "_probe_at")

    def __init__(self, failure_threshold: int = 3, cooldown_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic):
        self.failure_threshold = max(1, failure_threshold)
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._failures = 0  # consecutive
        self._opened_at: float | None = None  # None: closed
        # When the last probe went out: a probe that never reports back (its client left) frees the
        # slot after a cool-down, so the breaker cannot stay stuck open.
        self._probe_at: float | None = None

    @property
    def state(self) -> State:
        if self._opened_at is None:
            return "closed"
        return "open" if self._clock() - self._opened_at < self.cooldown_s else "half_open"

    @property
    def opened_at(self) -> float | None:
        return self._opened_at

    def allows(self) -> bool:
        """Whether a request may go now (without taking the probe slot)."""
        if self._opened_at is None:
            return True
        now = self._clock()
        if now - self._opened_at < self.cooldown_s:
            return False
        return self._probe_at is None or now - self._probe_at >= self.cooldown_s

    def attempt(self) -> None:
        """A request is going out now: when the breaker is not closed, it is the probe."""
        if self._opened_at is not None:
            self._probe_at = self._clock()

    def succeeded(self) -> None:
        self._failures = 0
        self._opened_at = self._probe_at = None

    def failed(self) -> None:
        self._failures += 1
        if self._opened_at is not None or self._failures >= self.failure_threshold:
            self.trip()

    def trip(self) -> None:
        """Open now (a failed probe or health check): the cool-down starts again."""
        self._opened_at = self._clock()
        self._probe_at = None
