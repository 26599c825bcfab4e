"""The dashboard on a real gateway with a real builtin engine (SmolLM2, its own process, registered and
heartbeating): a live map-reduce's graph through GET /v1/sessions/{id}/graph, scoped to its key (an admin
key sees it), and the page itself in Debian's chromium driven by Playwright.

The map-reduce waits on one variable, ``instructions``, that every map reads and the test sets: until then
its graph is deterministically all waiting; once it is set, every map becomes ready in the same moment
(so they form one task group for the reduce) and the graph goes to done."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator

import httpx
import pytest

from gateway.server.app import create_app
from gateway.config import AuthConfig, BuiltinConfig, DashboardConfig, EnginesConfig, GatewayConfig
from tests.support.models import SMOLLM
from tests.support.servers import free_port
from tests.support.markers import marks_users
from tests.support import plain_http

# Every test here loads a model in an engine process (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.model, pytest.mark.subprocess]

ALICE, BOB, ADMIN = "sk-alice", "sk-bob", "sk-admin"
SECRET = "dashboard-engine-secret"
SYSTEM = ("You summarise texts for a newsletter about the sea. Follow the instructions you are given "
          "and answer with one short sentence only.")
CHUNKS = ["Octopuses have three hearts and blue blood.", "Coral reefs cover less than one percent of the sea floor.",
          "The blue whale is the largest animal that ever lived."]
REPO = Path(__file__).resolve().parents[2]
ARTIFACTS = REPO / "artifacts" / "dashboard"  # gitignored: screenshots to look at after a run


@pytest.fixture(scope="module")
def benchmarks_dir(tmp_path_factory) -> Path:
    """A benchmarks folder holding one current result with a real PNG plot (drawn by matplotlib, as the benchmarks
    draw theirs), listed in current.json as benchmarks/report.py lists them, and a stray plot the panel ignores."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    directory = tmp_path_factory.mktemp("benchmarks")
    figure, axes = plt.subplots(figsize=(4, 2.5))
    axes.plot([1, 2, 3], [3, 1, 2], marker="o")
    axes.set_title("example benchmark")
    figure.savefig(directory / "example.png", dpi=80)
    figure.savefig(directory / "superseded.png", dpi=80)
    plt.close(figure)
    (directory / "notes.txt").write_text("not a plot")
    (directory / "current.json").write_text(json.dumps({"results": [
        {"what": "example throughput", "vs": "a baseline", "ratio": "1.23x", "host": "test host", "date": "2026-12-01",
         "command": "python -m benchmarks.example", "json": "example.json", "png": "example.png"}]}))
    return directory


@pytest.fixture(scope="module")
@marks_users("model", "subprocess")
def dashboard_gateway(serve_module, benchmarks_dir) -> Iterator[str]:
    """A gateway with client keys for alice and bob and an admin key, and a SmolLM2 engine process that
    registers with it and heartbeats (its load and KV use reach GET /v1/engines)."""
    config = GatewayConfig(builtin=BuiltinConfig(enabled=False),
                           auth=AuthConfig(api_keys=[ALICE, BOB], admin_keys=[ADMIN]),
                           engines=EnginesConfig(registration_secret=SECRET, heartbeat_timeout_s=60.0),
                           dashboard=DashboardConfig(benchmarks_dir=str(benchmarks_dir)))
    url = serve_module(create_app(config))
    engine = subprocess.Popen(
        [sys.executable, "-m", "gateway.server.cli", "engine", "--port", str(free_port()), "--gateway-url", url,
         "--heartbeat-interval", "0.5"],
        env={**os.environ, "HF_HUB_OFFLINE": "1", "PARROT_ENGINE_SECRET": SECRET})
    try:
        deadline = time.monotonic() + 300
        while SMOLLM not in plain_http.get(f"{url}/v1/models", headers=_auth(ALICE)).text:
            if engine.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("the builtin engine did not register with the gateway")
            time.sleep(0.5)
        yield url
    finally:
        engine.terminate()
        engine.wait(timeout=30)


def _auth(key: str) -> dict[str, str]:
    return {"authorization": f"Bearer {key}"}


@pytest.fixture
def alice(dashboard_gateway) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=dashboard_gateway, headers=_auth(ALICE), timeout=120) as client:
        yield client


def submit_map_reduce(client: httpx.Client) -> dict[str, Any]:
    """A session with three maps and a reduce, all waiting for ``instructions``; returns the ids."""
    session = client.post("/v1/sessions").json()["id"]
    instructions = client.post("/v1/vars", json={"session_id": session, "name": "instructions"}).json()["id"]
    summaries, maps = [], []
    for i, chunk in enumerate(CHUNKS):
        body = {"model": SMOLLM, "temperature": 0, "max_tokens": 12,
                "messages": [{"role": "system", "content": SYSTEM},
                             {"role": "user", "content": "{{instructions}}\n\nText: {{chunk}}"}],
                "parrot": {"session_id": session, "wait": False, "output": f"summary{i}",
                           "vars": {"instructions": {"id": instructions}, "chunk": {"value": chunk}}}}
        accepted = client.post("/v1/chat/completions", json=body)
        assert accepted.status_code == 202, accepted.text
        summaries.append(accepted.json()["parrot"]["output"]["id"])
        maps.append(accepted.json()["parrot"]["call_id"])
    names = "abc"
    reduce_body = {"model": SMOLLM, "temperature": 0, "max_tokens": 16,
                   "messages": [{"role": "user", "content": "Combine into one sentence:\n{{a}}\n{{b}}\n{{c}}"}],
                   "parrot": {"session_id": session, "wait": False, "output": "final",
                              "vars": {n: {"id": v} for n, v in zip(names, summaries)}}}
    accepted = client.post("/v1/chat/completions", json=reduce_body)
    assert accepted.status_code == 202, accepted.text
    result = accepted.json()["parrot"]
    return {"session": session, "instructions": instructions, "maps": maps, "summaries": summaries,
            "reduce": result["call_id"], "final": result["output"]["id"]}


def release(client: httpx.Client, job: dict[str, Any]) -> None:
    response = client.put(f"/v1/vars/{job['instructions']}", json={"value": "Summarise this text."})
    assert response.status_code == 200, response.text


def poll_graph(client: httpx.Client, session: str, until, *, timeout_s: float = 180.0) -> list[dict[str, Any]]:
    """Graphs read until ``until(graph)`` holds (the test fails past the deadline); all of them, in order."""
    seen, deadline = [], time.monotonic() + timeout_s
    while True:
        response = client.get(f"/v1/sessions/{session}/graph")
        assert response.status_code == 200, response.text
        seen.append(response.json())
        if until(seen[-1]):
            return seen
        if time.monotonic() > deadline:
            pytest.fail(f"graph not as expected within {timeout_s}s: {seen[-1]}")
        time.sleep(0.05)


def calls_by_id(graph: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {call["id"]: call for call in graph["calls"]}


def all_done(graph: dict[str, Any]) -> bool:
    return len(graph["calls"]) == 4 and all(call["state"] == "done" for call in graph["calls"])


def test_graph_of_a_live_map_reduce_shows_its_calls_going_to_done(dashboard_gateway, alice):
    job = submit_map_reduce(alice)
    session, maps, reduce = job["session"], job["maps"], job["reduce"]

    waiting = alice.get(f"/v1/sessions/{session}/graph").json()
    calls = calls_by_id(waiting)
    assert set(calls) == {*maps, reduce}
    assert {c["state"] for c in calls.values()} == {"waiting"}
    assert all(c["engine"] is None and c["started"] is None for c in calls.values())
    variables = {v["id"]: v for v in waiting["variables"]}
    assert variables[job["instructions"]]["consumers"] == maps and not variables[job["instructions"]]["ready"]
    for map_id, summary in zip(maps, job["summaries"]):
        assert variables[summary]["producer"] == map_id and variables[summary]["consumers"] == [reduce]
        chunk = variables[calls[map_id]["inputs"]["chunk"]]
        assert chunk["ready"] and chunk["producer"] is None and chunk["preview"] in CHUNKS
    assert variables[job["final"]]["producer"] == reduce and variables[job["final"]]["consumers"] == []

    release(alice, job)
    seen = poll_graph(alice, session, all_done)

    order = {"waiting": 0, "running": 1, "done": 2}
    for call_id in [*maps, reduce]:  # each call's states only move forward, ending in done
        states = [calls_by_id(graph)[call_id]["state"] for graph in seen]
        assert [order[s] for s in states] == sorted(order[s] for s in states) and states[-1] == "done"
    done = calls_by_id(seen[-1])
    engine_ids = {e["id"] for e in alice.get("/v1/engines").json()}
    for call in done.values():
        assert call["engine"] in engine_ids
        assert call["submitted"] <= call["started"] <= call["finished"]
    assert done[reduce]["started"] >= max(done[m]["finished"] for m in maps)  # it waited for its inputs
    for map_id in maps:  # the maps were one task group of throughput work for the reduce
        assert done[map_id]["group"] == reduce and done[map_id]["criteria"] == "throughput"
    final = alice.get(f"/v1/vars/{job['final']}").json()["value"]
    edges = {v["id"]: v for v in seen[-1]["variables"]}
    assert edges[job["final"]]["ready"] and final.startswith(edges[job["final"]]["preview"].removesuffix("…"))
    assert edges[job["final"]]["size"] == len(final.encode())

    mine = [s["id"] for s in alice.get("/v1/sessions").json()["data"]]
    assert session in mine
    engine = next(e for e in alice.get("/v1/engines").json() if e["id"] == done[reduce]["engine"])
    assert engine["requests_total"] >= 4 and engine["prefix_contexts"] >= 1  # the maps' system prompt is pinned


def test_another_key_gets_404_and_an_admin_key_sees_the_session(dashboard_gateway, alice):
    job = submit_map_reduce(alice)
    session = job["session"]
    with httpx.Client(base_url=dashboard_gateway, headers=_auth(BOB), timeout=30) as bob:
        assert bob.get(f"/v1/sessions/{session}/graph").status_code == 404
        assert session not in [s["id"] for s in bob.get("/v1/sessions").json()["data"]]
    with httpx.Client(base_url=dashboard_gateway, headers=_auth(ADMIN), timeout=30) as admin:
        graph = admin.get(f"/v1/sessions/{session}/graph")
        assert graph.status_code == 200 and set(calls_by_id(graph.json())) == {*job["maps"], job["reduce"]}
        listed = {s["id"]: s for s in admin.get("/v1/sessions").json()["data"]}
        assert listed[session]["pending_calls"] == 4
        own = {s["owner"] for s in alice.get("/v1/sessions").json()["data"]}
        assert listed[session]["owner"] in own and ALICE not in str(listed)  # a fingerprint, never the key
        assert admin.delete(f"/v1/sessions/{session}").status_code == 404  # to view, not to act for others
        assert admin.get(f"/v1/vars/{job['final']}").status_code == 404
    assert plain_http.get(f"{dashboard_gateway}/v1/sessions/{session}/graph").status_code == 401  # no key at all
    release(alice, job)
    poll_graph(alice, session, all_done)
    assert alice.delete(f"/v1/sessions/{session}").status_code == 200
    assert alice.get(f"/v1/sessions/{session}/graph").status_code == 404


# ---------------------------------------------------------------- the page in a real browser


def chromium_path() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.fail("Debian's chromium is needed for the dashboard's browser test: `apt-get install -y chromium` "
                    "(`make test` installs it when missing)")
    return path


@pytest.mark.browser
def test_dashboard_page_draws_the_live_dag_in_chromium(dashboard_gateway, alice):
    from playwright.sync_api import expect, sync_playwright

    job = submit_map_reduce(alice)
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=chromium_path(), headless=True,
                                             args=["--no-sandbox", "--disable-dev-shm-usage"])
        try:
            page = browser.new_page(viewport={"width": 1440, "height": 1100})
            errors: list[str] = []
            page.on("pageerror", lambda exc: errors.append(str(exc)))
            page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
            requests: list[Any] = []
            page.on("request", lambda request: requests.append(request))
            page.goto(f"{dashboard_gateway}/dashboard#{job['session']}")
            expect(page.locator("#status")).to_contain_text("enter an API key")
            page.fill("#api-key", ALICE)
            page.click("#key-form button[type=submit]")

            nodes = page.locator("#graph [data-call-id]")
            expect(nodes).to_have_count(4, timeout=30_000)
            for call_id in [*job["maps"], job["reduce"]]:
                expect(page.locator(f'#graph [data-call-id="{call_id}"]')).to_have_attribute("data-state", "waiting")
            expect(page.locator("#graph .group-box")).to_have_count(0)
            expect(page.locator(f'#sessions li[data-session-id="{job["session"]}"]')).to_have_class("selected")
            expect(page.locator("#engines tbody tr[data-engine-id]")).to_have_count(1)
            expect(page.locator("#batches tbody")).to_contain_text("No batch.")  # this key has none
            expect(page.locator("#benchmarks img")).to_have_count(1)
            expect(page.locator("#benchmarks figcaption")).to_contain_text("1.23x example throughput, vs a baseline")
            page.wait_for_function("() => document.querySelector('#benchmarks img').naturalWidth > 0")
            waiting_shot = ARTIFACTS / "dashboard_waiting.png"
            page.screenshot(path=str(waiting_shot), full_page=True)
            print(f"dashboard screenshot (waiting): {waiting_shot}")

            release(alice, job)
            expect(page.locator('#graph [data-call-id][data-state="done"]')).to_have_count(4, timeout=180_000)
            expect(page.locator("#graph .group-box")).to_have_count(1)  # the maps: one task group
            page.click(f'#graph [data-call-id="{job["reduce"]}"]')
            details = page.locator("#details")
            expect(details).to_be_visible()
            expect(details).to_contain_text(job["reduce"])
            expect(details).to_contain_text("summary0")
            done_shot = ARTIFACTS / "dashboard_done.png"
            page.screenshot(path=str(done_shot), full_page=True)
            print(f"dashboard screenshot (done): {done_shot}")

            assert ALICE not in page.url
            api_calls = [r for r in requests if "/v1/" in r.url]
            assert api_calls and all(ALICE not in r.url for r in requests)
            assert all(r.headers.get("authorization") == f"Bearer {ALICE}" for r in api_calls)
            assert errors == []
        finally:
            browser.close()
