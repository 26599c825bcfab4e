"""Three builtin engine processes behind one gateway (`parrot serve --engines 3`, tiny model), placed by
the global scheduler: a shared system prompt stays on one engine, a burst spills over, a task group lands
together, and an engine killed mid-request costs the client nothing it had not been sent yet."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from tests.support.servers import free_port, free_port_run
from tests.support.markers import marks_users

# Every test here loads a model in an engine process (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.model, pytest.mark.subprocess]

SYSTEM = "You are the booking assistant of Parrot Airways; answer in one short sentence. " * 24


class ParrotFleet:
    def __init__(self, model_dir: Path, engines: int):
        self.port = free_port()
        self.model = model_dir.name
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "PARROT_ENGINE_NUM_BLOCKS": "256",
               "PARROT_ENGINE_NUM_THREADS": "1", "PARROT_ENGINE_HEARTBEAT_INTERVAL": "0.5",
               "PARROT_HEARTBEAT_TIMEOUT_S": "3"}
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.server.cli", "serve", "--port", str(self.port), "--engines", str(engines),
             "--engine-port", str(free_port_run(engines)), "--model", str(model_dir), "--log-level", "warning"],
            env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        self.http = httpx.Client(base_url=self.url, timeout=60)

    def engines(self) -> list[dict]:
        try:
            return self.http.get("/v1/engines").json()
        except httpx.TransportError:
            return []

    def chat(self, system: str, user: str, **fields) -> httpx.Response:
        return self.http.post("/v1/chat/completions", json={
            "model": self.model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}], **fields})

    def close(self) -> None:
        self.http.close()
        if self.process.poll() is None:
            self.process.terminate()
            self.process.wait(timeout=60)


@pytest.fixture(scope="module")
@marks_users("subprocess")
def parrot_fleet(tiny_model_dir) -> Iterator[ParrotFleet]:
    served = ParrotFleet(tiny_model_dir, engines=3)
    try:
        yield served
    finally:
        served.close()


def healthy(parrot_fleet: ParrotFleet) -> list[dict]:
    return [e for e in parrot_fleet.engines() if e["healthy"]]


@pytest.mark.timeout(300)
def test_one_system_prompt_stays_on_one_engine_and_others_spread(parrot_fleet, wait_until):
    wait_until(lambda: len(healthy(parrot_fleet)) == 3, timeout_s=180)
    listed = healthy(parrot_fleet)
    assert len({e["url"] for e in listed}) == 3  # three processes, three ports

    where = [parrot_fleet.chat(SYSTEM, f"Question {i}?").headers["x-parrot-engine"] for i in range(6)]
    assert len(set(where)) == 1, where
    assert where[0] in {e["id"] for e in listed}

    others = {parrot_fleet.chat(f"You are assistant number {i} of a different company. " * 12, "Hi").headers["x-parrot-engine"]
              for i in range(6)}
    assert len(others) >= 2

    held = {e["id"]: e["held_prefix_tokens"] for e in parrot_fleet.engines()}
    assert held[where[0]] > 0


@pytest.mark.timeout(300)
def test_a_burst_on_one_prompt_spills_over_to_other_engines(parrot_fleet, wait_until):
    wait_until(lambda: len(healthy(parrot_fleet)) == 3, timeout_s=180)
    system = "You are the burst tester; reply briefly. " * 30

    async def burst() -> Counter:
        async with httpx.AsyncClient(base_url=parrot_fleet.url, timeout=120) as client:
            async def one(i: int) -> str:
                response = await client.post("/v1/chat/completions", json={
                    "model": parrot_fleet.model, "max_tokens": 48, "ignore_eos": True,
                    "messages": [{"role": "system", "content": system}, {"role": "user", "content": f"{i}"}]})
                assert response.status_code == 200, response.text
                return response.headers["x-parrot-engine"]
            return Counter(await asyncio.gather(*(one(i) for i in range(24))))

    placed = asyncio.run(burst())
    assert len(placed) >= 2, placed  # balance: one hot prompt does not pile onto one engine
    held = {e["id"]: e["held_prefix_tokens"] for e in parrot_fleet.engines()}
    assert all(held[engine] > 0 for engine in placed)  # replicated: each engine it went to holds it now


@pytest.mark.timeout(300)
def test_a_task_group_lands_on_one_engine(parrot_fleet, wait_until):
    wait_until(lambda: len(healthy(parrot_fleet)) == 3, timeout_s=180)
    document = "The quarterly report of Parrot Airways lists routes, parrot_fleet and fares. " * 20
    session = parrot_fleet.http.post("/v1/sessions", json={}).json()["id"]
    summaries = [parrot_fleet.http.post("/v1/vars", json={"session_id": session, "name": f"summary{i}"}).json()["id"]
                 for i in range(4)]
    # The reduce first: each map then feeds a consumer that waits for the others too (a task group).
    reduce = parrot_fleet.http.post("/v1/chat/completions", json={
        "model": parrot_fleet.model, "max_tokens": 8,
        "messages": [{"role": "user", "content": " ".join(f"{{{{s{i}}}}}" for i in range(4))}],
        "parrot": {"session_id": session, "wait": False, "vars": {f"s{i}": {"id": v} for i, v in enumerate(summaries)}}})
    assert reduce.status_code == 202, reduce.text

    async def maps() -> list[str]:
        async with httpx.AsyncClient(base_url=parrot_fleet.url, timeout=120) as client:
            async def one(i: int, summary: str) -> str:
                response = await client.post("/v1/chat/completions", json={
                    "model": parrot_fleet.model, "max_tokens": 8,
                    "messages": [{"role": "system", "content": document},
                                 {"role": "user", "content": f"Summarise part {i}: {{{{part}}}}"}],
                    "parrot": {"session_id": session, "criteria": "throughput",
                               "vars": {"part": {"value": f"section {i} text"}}, "output": {"id": summary}}})
                assert response.status_code == 200, response.text
                return response.headers["x-parrot-engine"]
            return await asyncio.gather(*(one(i, s) for i, s in enumerate(summaries)))

    assert len(set(asyncio.run(maps()))) == 1  # the group ran on one engine, forking one copy of the document
    reduced = parrot_fleet.http.get(f"/v1/vars/{reduce.json()['parrot']['output']['id']}", params={"wait": "true"})
    assert reduced.json()["ready"]


@pytest.mark.timeout(300)
def test_an_engine_killed_mid_request_is_replaced_for_the_client(parrot_fleet, wait_until):
    wait_until(lambda: len(healthy(parrot_fleet)) == 3, timeout_s=180)
    # Streamed: the first chunk names the engine; killed then, the stream ends with a clean error event.
    with parrot_fleet.http.stream("POST", "/v1/chat/completions", json={
            "model": parrot_fleet.model, "max_tokens": 2000, "ignore_eos": True, "stream": True,
            "messages": [{"role": "user", "content": "Count forever."}]}) as response:
        assert response.status_code == 200
        engine_id = response.headers["x-parrot-engine"]
        lines = response.iter_lines()
        assert next(line for line in lines if line.startswith("data: "))
        pid = next(e["pid"] for e in parrot_fleet.engines() if e["id"] == engine_id)
        os.kill(pid, signal.SIGKILL)
        rest = [line for line in lines if line.startswith("data: ")]
    assert rest[-1] == "data: [DONE]"
    assert any('"error"' in line for line in rest[-3:]), rest[-3:]
    wait_until(lambda: engine_id not in {e["id"] for e in parrot_fleet.engines()}, timeout_s=10)

    # Non-streamed: killed while it runs, the request is placed on another engine and answered. The two engines
    # left are enough (the killed one's restart is test_supervision.py's).
    assert len(healthy(parrot_fleet)) >= 2

    async def killed_mid_request() -> httpx.Response:
        async with httpx.AsyncClient(base_url=parrot_fleet.url, timeout=120) as client:
            request = asyncio.create_task(client.post("/v1/chat/completions", json={
                "model": parrot_fleet.model, "max_tokens": 400, "ignore_eos": True,
                "messages": [{"role": "user", "content": "Tell a long story."}]}))
            busy = None
            while busy is None:
                busy = next((e for e in (await client.get("/v1/engines")).json() if e["in_flight"]), None)
                await asyncio.sleep(0.01)
            os.kill(busy["pid"], signal.SIGKILL)
            response = await request
            assert response.headers["x-parrot-engine"] != busy["id"]
            return response

    answered = asyncio.run(killed_mid_request())
    assert answered.status_code == 200, answered.text
    assert answered.json()["usage"]["completion_tokens"] == 400
    assert parrot_fleet.chat(SYSTEM, "Still there?").status_code == 200  # the gateway kept serving
