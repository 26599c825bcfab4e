"""Gateway replicas sharing one real redis-server, and a gateway restarted on its SQLite file: real processes."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.support.fake_upstream import MODEL
from tests.support.gateway_process import GatewayProcess

pytestmark = pytest.mark.subprocess
KEY = "sk-replicas"
AUTH = {"authorization": f"Bearer {KEY}"}


@contextlib.contextmanager
def replicas(fake_url: str, state: str, count: int = 2, **options) -> Iterator[list[GatewayProcess]]:
    gateways = [GatewayProcess(fake_url, state, args=("--api-key", KEY), **options) for _ in range(count)]
    try:
        for gateway in gateways:
            gateway.start()
        yield gateways
    finally:
        for gateway in gateways:
            gateway.stop()


def chat(**extra) -> dict:
    return {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}], **extra}


async def burst(urls: list[str], count: int, body: dict) -> tuple[list[int], float]:
    """``count`` concurrent requests spread over ``urls``; their statuses and how long the burst took."""
    async with httpx.AsyncClient(timeout=30, limits=httpx.Limits(max_connections=count)) as client:
        started = time.monotonic()
        responses = await asyncio.gather(*(client.post(f"{urls[i % len(urls)]}/v1/chat/completions", json=body,
                                                       headers=AUTH) for i in range(count)))
        return [r.status_code for r in responses], time.monotonic() - started


def test_requests_per_minute_hold_exactly_across_two_replicas(fake_url, redis_server):
    per_minute = 20
    with replicas(fake_url, redis_server.url, env={"PARROT_QUOTA_REQUESTS_PER_MINUTE": str(per_minute)}) as (a, b):
        statuses, took = asyncio.run(burst([a.url, b.url], 3 * per_minute, chat()))
    admitted = statuses.count(200)
    assert set(statuses) == {200, 429}
    # Each replica alone would admit a minute's 20: together they admit 20, plus what refilled meanwhile (one
    # request every 3 s).
    assert per_minute <= admitted <= per_minute + int(took / 3), (admitted, took)


def test_concurrent_requests_hold_exactly_across_two_replicas(fake_url, redis_server):
    with replicas(fake_url, redis_server.url, env={"PARROT_QUOTA_CONCURRENT_REQUESTS": "3"}) as (a, b):
        statuses, took = asyncio.run(burst([a.url, b.url], 12, chat(fake={"delay_s": 3})))
        assert took < 6  # all were in flight together
        assert statuses.count(200) == 3 and statuses.count(429) == 9, statuses
        statuses, _ = asyncio.run(burst([a.url, b.url], 2, chat()))  # seats given back
        assert statuses == [200, 200]
