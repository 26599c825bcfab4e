"""Requests started per second on one engine, over the last few whole seconds (for GET /v1/engines)."""

from __future__ import annotations

import time
from typing import Callable


class RequestRate:
    """A counter per second in a ring of ``window_s`` + 1 slots (the whole seconds read, and the current
    one): counting costs a clock read and a few stores; reading sums the slots of the whole seconds."""

    __slots__ = ("total", "_window_s", "_seconds", "_counts", "_clock")

    def __init__(self, window_s: int = 10, clock: Callable[[], float] = time.monotonic):
        self.total = 0  # since the engine was added
        self._window_s = window_s
        self._seconds = [-1] * (window_s + 1)  # which second each slot counts
        self._counts = [0] * (window_s + 1)
        self._clock = clock

    def add(self) -> None:
        second = int(self._clock())
        slot = second % len(self._counts)
        if self._seconds[slot] != second:
            self._seconds[slot], self._counts[slot] = second, 0
        self._counts[slot] += 1
        self.total += 1

    def per_second(self) -> float:
        """Requests per second over the last ``window_s`` whole seconds (the current one not yet whole)."""
        now = int(self._clock())
        counted = sum(c for s, c in zip(self._seconds, self._counts) if now - self._window_s <= s < now)
        return counted / self._window_s
