"""Bounded polling for things that happen asynchronously: the test fails when they do not happen in time."""

from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import pytest


def wait_until(condition: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.05) -> Any:
    """Polls ``condition`` until it returns something truthy; fails the test after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")

        time.sleep(interval_s)


async def eventually(condition: Callable[[], Any], *, timeout_s: float = 10.0, interval_s: float = 0.005) -> Any:
    """``wait_until`` inside an event loop: polls without blocking it (the engine's thread does the work)."""
    deadline = time.monotonic() + timeout_s
    while not (value := condition()):
        if time.monotonic() > deadline:
            pytest.fail(f"condition not met within {timeout_s}s")
        await asyncio.sleep(interval_s)
    return value
