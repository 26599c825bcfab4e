"""Active health checks: every configured upstream's GET /models, periodically, feeds its circuit
breaker, so that a dead upstream is out of rotation before a client request finds out, and a
recovered one is back without waiting for a probe. (Registered engines prove their health by
heartbeating instead.)"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator

from gateway.registry import EngineRecord, EngineRegistry

logger = logging.getLogger(__name__)


async def _passes(record: EngineRecord, timeout_s: float) -> bool:
    """Whether the engine answers its health check; a healthy one's stats are refreshed on the way
    (what registered engines send with their heartbeats)."""
    try:
        async with asyncio.timeout(timeout_s):
            if not await record.engine.health():
                return False
            record.report(await record.engine.stats())
            return True
    except Exception:  # a timeout, or an answer that is no model list: failed either way
        return False


async def check_upstreams(registry: EngineRegistry, timeout_s: float) -> None:
    """One round, all upstreams at once: a failed check opens the circuit, a passed one closes it."""
    upstreams = [r for r in registry.records() if r.last_heartbeat is None]
    results = await asyncio.gather(*(_passes(r, timeout_s) for r in upstreams))
    for record, passed in zip(upstreams, results):
        if not passed:
            if record.breaker.state == "closed":
                logger.warning("upstream %r failed its health check: out of rotation", record.engine.name)
            record.breaker.trip()
        elif record.breaker.state != "closed":  # a closed one keeps its count of failed requests
            logger.info("upstream %r passed its health check: back in rotation", record.engine.name)
            record.breaker.succeeded()


async def _check_forever(registry: EngineRegistry, interval_s: float) -> None:
    while True:
        try:
            await check_upstreams(registry, timeout_s=interval_s)
        except Exception:  # a bug here must not end the checks for good
            logger.exception("upstream health checks failed")
        await asyncio.sleep(interval_s)


@contextlib.asynccontextmanager
async def health_checks(registry: EngineRegistry, interval_s: float) -> AsyncIterator[None]:
    """Checks every ``interval_s`` (the first at once) while the block runs; none when it is 0."""
    if interval_s <= 0:
        yield
        return
    task = asyncio.create_task(_check_forever(registry, interval_s), name="upstream-health-checks")
    try:
        yield
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
