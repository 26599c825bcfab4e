"""Gateway replicas sharing one real redis-server, and a gateway restarted on its SQLite file: real processes."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import threading
import time
from pathlib import Path
from typing import Iterator

import httpx
import pytest

from engines.builtin.config import EngineConfig
from engines.builtin.server.app import create_app as create_engine_app
from tests.support import fake_upstream
from tests.support.fake_upstream import MODEL
from tests.support.gateway_process import GatewayProcess
from tests.support import plain_http

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
    response = plain_http.post(f"{url}{path}", json=body, headers=AUTH, timeout=30)
    assert response.status_code in (200, 201, 202), response.text
    return response.json()


def get(url: str, path: str, **params) -> httpx.Response:
    return plain_http.get(f"{url}{path}", params=params, headers=AUTH, timeout=60)


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
        assert plain_http.get(f"{b.url}/v1/vars/{topic['id']}", timeout=10).status_code in (401, 404)
        # Deleted on B: gone on A too.
        assert plain_http.delete(f"{b.url}/v1/sessions/{session}", headers=AUTH, timeout=30).status_code == 200
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


LEASE_S = 2.0  # short, so that a takeover is quick to wait for


def test_a_call_of_a_replica_killed_mid_call_is_taken_over_by_the_other(fake_url, redis_server):
    """kill -9 A while its call runs: B takes the call over when its lease expires and runs it again; a waiter on B
    gets the value an uninterrupted run gives."""
    with replicas(fake_url, redis_server.url, env={"PARROT_STATE_LEASE_S": str(LEASE_S)}) as (a, b):
        session = post(a.url, "/v1/sessions", {})["id"]
        body = chat(fake={"delay_s": 1.0}, messages=[{"role": "user", "content": "taken over"}])
        uninterrupted = post(a.url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
        output = post(a.url, "/v1/chat/completions", {**body, "parrot": {"session_id": session, "wait": False}}
                      )["parrot"]["output"]["id"]
        assert not get(b.url, f"/v1/vars/{output}").json()["ready"]
        a.kill()  # kill -9 mid-call
        killed = time.monotonic()
        taken = get(b.url, f"/v1/vars/{output}", wait="true", timeout=40).json()
        took = time.monotonic() - killed
        assert taken["ready"] and taken["error"] is None and taken["value"] == uninterrupted, taken
        assert took <= LEASE_S + 2 + 1.0, took  # the lease, the takeover, then the call's own second


def submit_dag(url: str, session: str) -> dict[str, str]:
    """A three-call DAG, queued: a story about a topic, a retelling of it in a style its client binds later, and a
    title of the retelling (greedy). Returns the variable ids by name."""
    def call(prompt: str, vars: dict, max_tokens: int) -> str:
        return post(url, "/v1/chat/completions", chat(
            max_tokens=max_tokens, temperature=0, messages=[{"role": "user", "content": prompt}],
            parrot={"session_id": session, "wait": False, "vars": vars}))["parrot"]["output"]["id"]

    style = post(url, "/v1/vars", {"session_id": session, "name": "style"})["id"]
    story = call("Tell a story about {{topic}}.", {"topic": {"value": "a parrot"}}, 160)
    retold = call("Retell it {{style}}: {{story}}", {"style": {"id": style}, "story": {"id": story}}, 48)
    title = call("A title for: {{retold}}", {"retold": {"id": retold}}, 16)
    return {"style": style, "story": story, "retold": retold, "title": title}


def test_a_dag_of_a_replica_killed_mid_run_is_finished_by_the_other_as_an_uninterrupted_run(
        serve, tiny_model_dir, redis_server):
    """kill -9 A with a DAG running on it (a real builtin engine, greedy): B takes its calls over and finishes the
    DAG with the same outputs as an uninterrupted run."""
    engine = serve(create_engine_app(EngineConfig(model=str(tiny_model_dir)), model_name=MODEL))
    with replicas(engine, redis_server.url, env={"PARROT_STATE_LEASE_S": str(LEASE_S)}) as (a, b):
        started = time.monotonic()
        expected = submit_dag(a.url, post(a.url, "/v1/sessions", {})["id"])
        story_s = time.monotonic() - started if get(a.url, f"/v1/vars/{expected['story']}", wait="true",
                                                    timeout=60).json()["ready"] else 60
        assert plain_http.put(f"{a.url}/v1/vars/{expected['style']}", json={"value": "briefly"}, headers=AUTH,
                         timeout=10).status_code == 200
        uninterrupted = {name: get(a.url, f"/v1/vars/{var}", wait="true", timeout=60).json()["value"]
                         for name, var in expected.items()}

        interrupted = submit_dag(a.url, post(a.url, "/v1/sessions", {})["id"])
        a.kill()  # kill -9 mid-DAG: the story generating (or queued), the rest waiting for it and the style
        killed = time.monotonic()
        assert plain_http.put(f"{b.url}/v1/vars/{interrupted['style']}", json={"value": "briefly"}, headers=AUTH,
                         timeout=10).status_code == 200
        story = get(b.url, f"/v1/vars/{interrupted['story']}", wait="true", timeout=60).json()
        took = time.monotonic() - killed
        finished = {name: get(b.url, f"/v1/vars/{var}", wait="true", timeout=60).json() for name, var in
                    interrupted.items()}
    assert story["ready"] and story["error"] is None, story
    assert {name: view["value"] for name, view in finished.items()} == uninterrupted
    assert took <= LEASE_S + 2 + story_s, (took, story_s)  # taken over within the lease + 2 s, then run again


def test_a_response_stored_on_one_replica_is_read_and_continued_on_the_other(fake_url, fake_stats, redis_server):
    with replicas(fake_url, redis_server.url) as (a, b):
        first = post(a.url, "/v1/responses", {"model": MODEL, "input": "remember parrots", "max_output_tokens": 8})
        read = get(b.url, f"/v1/responses/{first['id']}")
        assert read.status_code == 200 and read.json()["output"] == first["output"], read.text
        items = get(b.url, f"/v1/responses/{first['id']}/input_items").json()["data"]
        assert "remember parrots" in str(items[0]["content"])
        # The next turn on B continues the conversation A stored: the engine gets both turns.
        post(b.url, "/v1/responses", {"model": MODEL, "input": "and now?", "previous_response_id": first["id"]})
        sent = [m["content"] for m in fake_stats()["last_body"]["messages"]]
        assert sent[0] == "remember parrots" and sent[-1] == "and now?", sent
        assert plain_http.delete(f"{b.url}/v1/responses/{first['id']}", headers=AUTH, timeout=10).status_code == 200
        assert get(a.url, f"/v1/responses/{first['id']}").status_code == 404  # deleted on B: gone on A too


def test_a_batch_of_a_replica_killed_mid_run_is_finished_by_the_other_each_line_once(fake_url, redis_server):
    lines = [{"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": chat(messages=[{"role": "user", "content": f"line {i}"}], fake={"delay_s": 0.3})}
             for i in range(16)]
    data = b"".join(json.dumps(line).encode() + b"\n" for line in lines)
    with replicas(fake_url, redis_server.url, env={"PARROT_STATE_LEASE_S": str(LEASE_S)}) as (a, b):
        uploaded = plain_http.post(f"{a.url}/v1/files", headers=AUTH, timeout=30, data={"purpose": "batch"},
                              files={"file": ("in.jsonl", data)}).json()
        assert plain_http.get(f"{b.url}/v1/files/{uploaded['id']}/content", headers=AUTH, timeout=10).content == data
        batch = post(a.url, "/v1/batches", {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions",
                                            "completion_window": "24h"})
        deadline = time.monotonic() + 30
        while get(b.url, f"/v1/batches/{batch['id']}").json()["request_counts"]["completed"] == 0:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        a.kill()  # kill -9 mid-batch: B resumes it once A's lease expires
        deadline = time.monotonic() + 60
        while (done := get(b.url, f"/v1/batches/{batch['id']}").json())["status"] != "completed":
            assert time.monotonic() < deadline, done
            time.sleep(0.2)
        output = plain_http.get(f"{b.url}/v1/files/{done['output_file_id']}/content", headers=AUTH, timeout=10).text
    answered = sorted(json.loads(line)["custom_id"] for line in output.splitlines())
    assert answered == sorted(f"req-{i}" for i in range(16)), answered  # each line once
    assert done["request_counts"] == {"total": 16, "completed": 16, "failed": 0}


def test_an_engine_registered_with_one_replica_serves_from_the_other(fake_url, serve, redis_server):
    secret = {"PARROT_ENGINE_SECRET": "engine-secret", "PARROT_HEARTBEAT_TIMEOUT_S": "3"}
    far = serve(fake_upstream.app)  # an engine of its own (any OpenAI-compatible server)
    with replicas(fake_url, redis_server.url, env=secret) as (a, b):
        registered = plain_http.post(f"{a.url}/v1/engines", json={"name": "far", "url": far, "models": ["far-model"]},
                                headers={"authorization": "Bearer engine-secret"}, timeout=10)
        assert registered.status_code == 201, registered.text
        engine, token = registered.json()["id"], registered.json()["token"]
        deadline = time.monotonic() + 5
        while "far-model" not in get(b.url, "/v1/models").text:
            assert time.monotonic() < deadline
            time.sleep(0.1)
        answer = post(b.url, "/v1/chat/completions", chat(model="far-model"))
        assert answer["choices"][0]["message"]["content"]
        # Its heartbeats are taken by B too (same id, same token); once they stop, it expires on both.
        beat = plain_http.post(f"{b.url}/v1/engines/{engine}/heartbeat", json={}, timeout=10,
                          headers={"authorization": f"Bearer {token}"})
        assert beat.status_code == 200, beat.text
        deadline = time.monotonic() + 15
        while any("far-model" in get(r.url, "/v1/models").text for r in (a, b)):
            assert time.monotonic() < deadline
            time.sleep(0.2)


def test_the_store_going_away_gives_503s_and_the_gateway_recovers_when_it_is_back(fake_url, tmp_path):
    from tests.support.redis_server import RedisServer

    server = RedisServer(tmp_path)
    server.start()
    try:
        with replicas(fake_url, server.url, count=1, env={"PARROT_QUOTA_REQUESTS_PER_MINUTE": "1000"}) as (a,):
            session = post(a.url, "/v1/sessions", {})["id"]
            assert plain_http.get(f"{a.url}/health/ready", timeout=10).json()["state_store_ok"]
            server.stop()
            refused = plain_http.post(f"{a.url}/v1/sessions", headers=AUTH, timeout=30)
            assert refused.status_code == 503 and refused.json()["error"]["code"] == "state_unavailable", refused.text
            assert refused.headers["retry-after"] == "1"
            chat_refused = plain_http.post(f"{a.url}/v1/chat/completions", json=chat(), headers=AUTH, timeout=30)
            assert chat_refused.status_code == 503, chat_refused.text  # its rate quota cannot be counted
            ready = plain_http.get(f"{a.url}/health/ready", timeout=30)
            assert ready.status_code == 503 and not ready.json()["state_store_ok"]
            errors = next(line for line in plain_http.get(f"{a.url}/metrics", timeout=10).text.splitlines()
                          if line.startswith("parrot:state_errors_total"))
            assert float(errors.split()[-1]) >= 2, errors
            server.start()  # the same port, empty: a new server
            deadline = time.monotonic() + 20
            while plain_http.get(f"{a.url}/health/ready", timeout=30).status_code != 200:
                assert time.monotonic() < deadline
                time.sleep(0.2)
            assert post(a.url, "/v1/sessions", {})["id"] != session
            assert plain_http.post(f"{a.url}/v1/chat/completions", json=chat(), headers=AUTH, timeout=30).status_code == 200
    finally:
        server.stop()


# ---------------------------------------------------------------- a gateway restarted on its SQLite file


def test_a_gateway_killed_mid_dag_and_restarted_completes_it_and_keeps_every_variable(fake_url, tmp_path):
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
        # A DAG mid-run: a call running, and one that waits for its output.
        slow = chat(fake={"delay_s": 2.0}, messages=[{"role": "user", "content": "resumed"}])
        uninterrupted = post(gateway.url, "/v1/chat/completions", slow)["choices"][0]["message"]["content"]
        running = post(gateway.url, "/v1/chat/completions", {**slow, "parrot": {"session_id": session, "wait": False}}
                       )["parrot"]["output"]["id"]
        consumer = post(gateway.url, "/v1/chat/completions", chat(
            messages=[{"role": "user", "content": "then {{x}}"}],
            parrot={"session_id": session, "wait": False, "vars": {"x": {"id": running}}}))["parrot"]["output"]["id"]
        stored = post(gateway.url, "/v1/responses", {"model": MODEL, "input": "kept across a restart"})
        gateway.kill()  # kill -9, with a call running

        gateway.start()
        for var_id, value in values.items():
            assert get(gateway.url, f"/v1/vars/{var_id}").json()["value"] == value
        assert get(gateway.url, f"/v1/vars/{produced}").json()["value"] == produced_value
        assert get(gateway.url, f"/v1/vars/{default_var['id']}").json()["value"] == "kept"
        assert get(gateway.url, f"/v1/responses/{stored['id']}").json()["output"] == stored["output"]
        assert post(gateway.url, "/v1/vars", {"name": "second"})["session_id"] == default_var["session_id"]
        # The calls the killed process ran are run again by the new one: the DAG completes.
        resumed = get(gateway.url, f"/v1/vars/{running}", wait="true", timeout=30).json()
        assert resumed["ready"] and resumed["value"] == uninterrupted, resumed
        then = get(gateway.url, f"/v1/vars/{consumer}", wait="true", timeout=30).json()
        assert then["ready"] and f"then {uninterrupted}" in then["value"], then
        assert not get(gateway.url, f"/v1/vars/{unbound}").json()["ready"]  # still waits for its client
        assert plain_http.put(f"{gateway.url}/v1/vars/{unbound}", json={"value": "bound after"}, headers=AUTH,
                         timeout=10).status_code == 200
        again = post(gateway.url, "/v1/chat/completions", chat(
            messages=[{"role": "user", "content": "and {{y}}"}],
            parrot={"session_id": session, "vars": {"y": {"id": unbound}}}))
        assert "and bound after" in again["choices"][0]["message"]["content"]
        names = {v["name"] for v in get(gateway.url, f"/v1/sessions/{session}/vars").json()["data"]}
        assert {f"v{i}" for i in range(5)} | {"unbound", "output"} <= names
    finally:
        gateway.stop()


def test_a_stream_cut_by_a_restart_ends_with_an_error_event_and_its_call_goes_on(fake_url, tmp_path):
    config = tmp_path / "parrot.toml"
    config.write_text("[server]\nshutdown_grace_s = 0.5\n")  # streams still open then are cut
    gateway = GatewayProcess(fake_url, str(tmp_path / "state.sqlite3"), args=("--api-key", KEY),
                             env={"PARROT_CONFIG": str(config)})
    # 16 chunks 0.25 s apart: still streaming when the 0.5 s grace that follows the SIGTERM ends
    body = chat(max_tokens=16, messages=[{"role": "user", "content": "a b c d e f g h i j"}],
                fake={"chunk_delay_s": 0.25})
    gateway.start()
    try:
        uninterrupted = post(gateway.url, "/v1/chat/completions", body)["choices"][0]["message"]["content"]
        events: list[dict] = []

        def read() -> None:
            with plain_http.stream("POST", f"{gateway.url}/v1/chat/completions", headers=AUTH, timeout=60,
                              json={**body, "stream": True, "parrot": {"vars": {}}}) as response:
                events.extend(json.loads(line[6:]) for line in response.iter_lines()
                              if line.startswith("data: {"))

        reader = threading.Thread(target=read)
        reader.start()
        deadline = time.monotonic() + 30
        while len(events) < 2:  # it streams
            assert time.monotonic() < deadline and reader.is_alive()
            time.sleep(0.05)
        gateway.process.send_signal(signal.SIGTERM)  # a restart: the process stops cleanly
        reader.join(30)
        assert events[-1]["error"]["code"] == "stream_cut", events[-1]
        output = events[0]["parrot"]["output"]["id"]
        gateway.process.wait(30)
        gateway.start()
        resumed = get(gateway.url, f"/v1/vars/{output}", wait="true", timeout=30).json()
        assert resumed["ready"] and resumed["value"] == uninterrupted, resumed
    finally:
        gateway.stop()


# ---------------------------------------------------------------- background responses survive their replica


def poll_response(url: str, response_id: str, timeout_s: float = 60) -> tuple[dict, list[str]]:
    """Polls GET /v1/responses/{id} until the response ends; the response and the statuses seen on the way."""
    seen: list[str] = []
    deadline = time.monotonic() + timeout_s
    while True:
        response = get(url, f"/v1/responses/{response_id}")
        assert response.status_code == 200, response.text
        body = response.json()
        if not seen or seen[-1] != body["status"]:
            seen.append(body["status"])
        if body["status"] not in ("queued", "in_progress"):
            return body, seen
        assert time.monotonic() < deadline, seen
        time.sleep(0.05)


def background_body(delay_s: float) -> dict:
    return {"model": MODEL, "input": "taken over in the background", "max_output_tokens": 8,
            "fake": {"delay_s": delay_s}}


def test_a_background_response_of_a_replica_killed_mid_run_is_finished_by_the_other(fake_url, redis_server):
    """kill -9 A while its background response runs: B runs it again once A's lease expires; it ends completed,
    with the output an uninterrupted run gives, read alike from B and from A started again."""
    with replicas(fake_url, redis_server.url, env={"PARROT_STATE_LEASE_S": str(LEASE_S)}) as (a, b):
        uninterrupted = post(a.url, "/v1/responses", background_body(0.0))["output"]
        queued = post(a.url, "/v1/responses", {**background_body(3.0), "background": True})
        assert queued["status"] == "queued"
        deadline = time.monotonic() + 10
        while get(b.url, f"/v1/responses/{queued['id']}").json()["status"] != "in_progress":  # A runs it
            assert time.monotonic() < deadline
            time.sleep(0.05)
        a.kill()  # kill -9 mid-run
        killed = time.monotonic()
        ended, seen = poll_response(b.url, queued["id"])
        took = time.monotonic() - killed
        print(f"\nbackground response taken over: completed {took:.2f} s after the kill "
              f"(lease {LEASE_S} s, its run 3 s)")
        assert ended["status"] == "completed" and ended["output"][0]["content"] == uninterrupted[0]["content"], ended
        assert seen[0] == "in_progress", seen
        a.start()
        assert get(a.url, f"/v1/responses/{queued['id']}").json() == ended  # one end, read alike from both


def test_a_semantic_background_response_of_a_killed_replica_is_run_again_by_the_other(fake_url, redis_server):
    with replicas(fake_url, redis_server.url, env={"PARROT_STATE_LEASE_S": str(LEASE_S)}) as (a, b):
        queued = post(a.url, "/v1/responses", {**background_body(3.0), "background": True, "input": "echo {{t}}",
                                               "parrot": {"vars": {"t": {"value": "parrots"}}}})
        deadline = time.monotonic() + 10
        while get(b.url, f"/v1/responses/{queued['id']}").json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        a.kill()
        ended, _ = poll_response(b.url, queued["id"])
        assert ended["status"] == "completed" and "echo parrots" in ended["output"][0]["content"][0]["text"], ended


def test_a_background_response_cancelled_on_another_replica_stops_where_it_runs(fake_url, fake_stats, redis_server):
    with replicas(fake_url, redis_server.url) as (a, b):
        abandoned = fake_stats()["requests_abandoned"]
        queued = post(a.url, "/v1/responses", {**background_body(30.0), "background": True})
        deadline = time.monotonic() + 10
        while get(b.url, f"/v1/responses/{queued['id']}").json()["status"] != "in_progress":
            assert time.monotonic() < deadline
            time.sleep(0.05)
        cancelled = post(b.url, f"/v1/responses/{queued['id']}/cancel", {})
        assert cancelled["status"] == "cancelled", cancelled
        deadline = time.monotonic() + 10
        while fake_stats()["requests_abandoned"] == abandoned:  # A stopped its request to the engine
            assert time.monotonic() < deadline
            time.sleep(0.05)
        for replica in (a, b):
            assert get(replica.url, f"/v1/responses/{queued['id']}").json()["status"] == "cancelled"


def test_a_background_response_of_a_gateway_killed_mid_run_completes_after_its_restart(fake_url, tmp_path):
    gateway = GatewayProcess(fake_url, str(tmp_path / "state.sqlite3"), args=("--api-key", KEY))
    gateway.start()
    try:
        uninterrupted = post(gateway.url, "/v1/responses", background_body(0.0))["output"]
        queued = post(gateway.url, "/v1/responses", {**background_body(3.0), "background": True})
        gateway.kill()  # kill -9 mid-run
        gateway.start()
        ended, _ = poll_response(gateway.url, queued["id"])
        assert ended["status"] == "completed" and ended["output"][0]["content"] == uninterrupted[0]["content"], ended
    finally:
        gateway.stop()


def test_a_keys_stored_responses_are_bounded_across_replicas(fake_url, redis_server, tmp_path):
    """[responses] max_stored and max_stored_bytes hold for the key across both replicas, not for each."""
    config = tmp_path / "parrot.toml"
    config.write_text("[responses]\nmax_stored = 3\nmax_stored_bytes = 10000\n")
    with replicas(fake_url, redis_server.url, env={"PARROT_CONFIG": str(config)}) as (a, b):
        def create(i: int, text: str) -> str:
            return post((a, b)[i % 2].url, "/v1/responses", {"model": MODEL, "input": text, "fake": {"words": 2}})["id"]

        def readable(ids: list[str]) -> dict[str, list[str]]:
            return {r.url: [i for i in ids if get(r.url, f"/v1/responses/{i}").status_code == 200] for r in (a, b)}

        small = [create(i, f"turn {i}") for i in range(6)]
        assert readable(small) == {a.url: small[-3:], b.url: small[-3:]}  # each alone would keep 3 of its own
        large = [create(i, f"turn {i} " + "x" * 4000) for i in range(3)]  # about 4.5 KB each: two fit in 10,000
        assert readable(small + large) == {a.url: large[-2:], b.url: large[-2:]}

        async def burst() -> list[str]:
            async with httpx.AsyncClient(timeout=30, headers=AUTH) as client:
                made = await asyncio.gather(*(client.post(f"{(a, b)[i % 2].url}/v1/responses", json={
                    "model": MODEL, "input": f"burst {i}", "max_output_tokens": 4}) for i in range(12)))
                return [m.json()["id"] for m in made]

        made = asyncio.run(burst())
        assert {url: len(ids) for url, ids in readable(large + made).items()} == {a.url: 3, b.url: 3}
