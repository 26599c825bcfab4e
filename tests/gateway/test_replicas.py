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


# ---------------------------------------------------------------- sessions and variables across replicas


def post(url: str, path: str, body: dict) -> dict:
    response = httpx.post(f"{url}{path}", json=body, headers=AUTH, timeout=30)
    assert response.status_code in (200, 201, 202), response.text
    return response.json()


def get(url: str, path: str, **params) -> httpx.Response:
    return httpx.get(f"{url}{path}", params=params, headers=AUTH, timeout=60)


def test_a_session_made_on_one_replica_is_used_from_the_other(fake_url, redis_server):
    with replicas(fake_url, redis_server.url) as (a, b):
        session = post(a.url, "/v1/sessions", {})["id"]
        topic = post(a.url, "/v1/vars", {"session_id": session, "name": "topic", "value": "parrots"})
        assert get(b.url, f"/v1/vars/{topic['id']}").json()["value"] == "parrots"
        more = post(b.url, "/v1/vars", {"session_id": session, "name": "colour", "value": "green"})
        names = {v["name"] for v in get(a.url, f"/v1/sessions/{session}/vars").json()["data"]}
        assert names == {"topic", "colour"}
        # A semantic request on B binds a variable made on A (the fake upstream echoes the prompt).
        answer = post(b.url, "/v1/chat/completions", chat(
            messages=[{"role": "user", "content": "{{t}} are {{c}}"}],
            parrot={"session_id": session, "vars": {"t": {"id": topic["id"]}, "c": {"id": more["id"]}}}))
        output = answer["parrot"]["output"]["id"]
        assert "parrots are green" in answer["choices"][0]["message"]["content"]
        assert "parrots are green" in get(a.url, f"/v1/vars/{output}").json()["value"]
        # Another key sees none of it, on either replica.
        assert httpx.get(f"{b.url}/v1/vars/{topic['id']}", timeout=10).status_code in (401, 404)
        # Deleted on B: gone on A too.
        assert httpx.delete(f"{b.url}/v1/sessions/{session}", headers=AUTH, timeout=30).status_code == 200
        assert get(a.url, f"/v1/vars/{topic['id']}").status_code == 404


def test_a_variable_produced_on_one_replica_wakes_a_waiter_on_the_other(fake_url, redis_server):
    with replicas(fake_url, redis_server.url) as (a, b):
        session = post(a.url, "/v1/sessions", {})["id"]
        pending = post(a.url, "/v1/vars", {"session_id": session, "name": "later"})["id"]

        async def scenario() -> tuple[dict, float, dict, float]:
            async with httpx.AsyncClient(timeout=60, headers=AUTH) as client:
                waiting = asyncio.ensure_future(client.get(f"{b.url}/v1/vars/{pending}",
                                                           params={"wait": "true", "timeout": 30}))
                await asyncio.sleep(1.0)
                assert not waiting.done()  # it waits on B
                bound = time.monotonic()
                put = await client.put(f"{a.url}/v1/vars/{pending}", json={"value": "now"})
                assert put.status_code == 200, put.text
                woken = (await waiting).json()
                woke_after = time.monotonic() - bound
                # A call queued on A (its answer 1 s late): a waiter on B gets its output when A binds it.
                queued = await client.post(f"{a.url}/v1/chat/completions", json=chat(
                    fake={"delay_s": 1.0}, messages=[{"role": "user", "content": "then {{x}}"}],
                    parrot={"session_id": session, "wait": False, "vars": {"x": {"id": pending}}}))
                assert queued.status_code == 202, queued.text
                output = queued.json()["parrot"]["output"]["id"]
                started = time.monotonic()
                produced = (await client.get(f"{b.url}/v1/vars/{output}", params={"wait": "true", "timeout": 30})).json()
                return woken, woke_after, produced, time.monotonic() - started

        woken, woke_after, produced, took = asyncio.run(scenario())
        assert woken["ready"] and woken["value"] == "now"
        assert woke_after < 1.0, woke_after  # a wake-up, not a poll
        assert produced["ready"] and "then now" in produced["value"] and 0.9 < took < 5, (produced, took)


def test_a_call_lost_with_its_replica_fails_its_output_on_the_other(fake_url, redis_server):
    """Not taken over (yet): the call is not run again, but a waiter on another replica learns that its
    producer is gone when the dead replica's heartbeat expires, instead of waiting for its input timeout."""
    with replicas(fake_url, redis_server.url) as (a, b):
        session = post(a.url, "/v1/sessions", {})["id"]
        output = post(a.url, "/v1/chat/completions", chat(
            fake={"delay_s": 120}, parrot={"session_id": session, "wait": False}))["parrot"]["output"]["id"]
        assert not get(b.url, f"/v1/vars/{output}").json()["ready"]
        a.kill()  # kill -9 mid-call
        started = time.monotonic()
        lost = get(b.url, f"/v1/vars/{output}", wait="true", timeout=40).json()
        assert lost["ready"] and "lost" in lost["error"], lost
        assert time.monotonic() - started < 25


def test_the_store_going_away_gives_503s_and_the_gateway_recovers_when_it_is_back(fake_url, tmp_path):
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    try:
        with replicas(fake_url, server.url, count=1, env={"PARROT_QUOTA_REQUESTS_PER_MINUTE": "1000"}) as (a,):
            session = post(a.url, "/v1/sessions", {})["id"]
            assert httpx.get(f"{a.url}/health/ready", timeout=10).json()["state_store_ok"]
            server.stop()
            refused = httpx.post(f"{a.url}/v1/sessions", headers=AUTH, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "state_unavailable", refused.text
            assert refused.headers["retry-after"] == "1"
            chat_refused = httpx.post(f"{a.url}/v1/chat/completions", json=chat(), headers=AUTH, timeout=30)
            assert chat_refused.status_code == 503, chat_refused.text  # its rate quota cannot be counted
            ready = httpx.get(f"{a.url}/health/ready", timeout=30)
            assert ready.status_code == 503 and not ready.json()["state_store_ok"]
            errors = next(line for line in httpx.get(f"{a.url}/metrics", timeout=10).text.splitlines()
                          if line.startswith("parrot:state_errors_total"))
            assert float(errors.split()[-1]) >= 2, errors
            server.start()  # the same port, empty: a new server
            deadline = time.monotonic() + 20
            while httpx.get(f"{a.url}/health/ready", timeout=30).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert post(a.url, "/v1/sessions", {})["id"] != session
            assert httpx.post(f"{a.url}/v1/chat/completions", json=chat(), headers=AUTH, timeout=30).status_code == 200
    finally:
        server.stop()


# ---------------------------------------------------------------- a gateway restarted on its SQLite file


def test_a_gateway_killed_and_restarted_keeps_its_sessions_and_finished_variables(fake_url, tmp_path):
    state = str(tmp_path / "state.sqlite3")
    gateway = GatewayProcess(fake_url, state, args=("--api-key", KEY))
    gateway.start()
    try:
        session = post(gateway.url, "/v1/sessions", {})["id"]
        values = {post(gateway.url, "/v1/vars", {"session_id": session, "name": f"v{i}", "value": f"value {i}"})["id"]:
                  f"value {i}" for i in range(5)}
        unbound = post(gateway.url, "/v1/vars", {"session_id": session, "name": "unbound"})["id"]
        answer = post(gateway.url, "/v1/chat/completions", chat(
            messages=[{"role": "user", "content": "echo {{x}}"}],
            parrot={"session_id": session, "vars": {"x": {"id": next(iter(values))}}}))
        produced = answer["parrot"]["output"]["id"]
        produced_value = answer["choices"][0]["message"]["content"]
        default_var = post(gateway.url, "/v1/vars", {"name": "in-default", "value": "kept"})  # the key's default session
        running = post(gateway.url, "/v1/chat/completions", chat(
            fake={"delay_s": 60}, parrot={"session_id": session, "wait": False}))["parrot"]["output"]["id"]
        gateway.kill()  # kill -9, with a call running

        gateway.start()
        for var_id, value in values.items():
            assert get(gateway.url, f"/v1/vars/{var_id}").json()["value"] == value
        assert get(gateway.url, f"/v1/vars/{produced}").json()["value"] == produced_value
        assert get(gateway.url, f"/v1/vars/{default_var['id']}").json()["value"] == "kept"
        assert post(gateway.url, "/v1/vars", {"name": "second"})["session_id"] == default_var["session_id"]
        lost = get(gateway.url, f"/v1/vars/{running}").json()  # its producer died with the process: it failed
        assert lost["ready"] and "lost" in lost["error"], lost
        assert not get(gateway.url, f"/v1/vars/{unbound}").json()["ready"]  # still waits for its client
        assert httpx.put(f"{gateway.url}/v1/vars/{unbound}", json={"value": "bound after"}, headers=AUTH,
                         timeout=10).status_code == 200
        again = post(gateway.url, "/v1/chat/completions", chat(
            messages=[{"role": "user", "content": "and {{y}}"}],
            parrot={"session_id": session, "vars": {"y": {"id": unbound}}}))
        assert "and bound after" in again["choices"][0]["message"]["content"]
        names = {v["name"] for v in get(gateway.url, f"/v1/sessions/{session}/vars").json()["data"]}
        assert {f"v{i}" for i in range(5)} | {"unbound", "output"} <= names
    finally:
        gateway.stop()
