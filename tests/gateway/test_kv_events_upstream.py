"""Builtin engine processes publishing their KV-cache events as vLLM 0.32 does (``--kv-events-endpoint``), registered
with a gateway as plain upstreams with ``kv_events`` on: the gateway's view of each engine is what the engine holds;
a request goes where its prefix was computed, even by a client the gateway never saw; a waiting call's prefix
prefilled ahead and then evicted is prefilled again (the engine's own counters); and answers are the plain ones."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from typing import Iterator

import httpx
import pytest

from gateway.config import KVEventsConfig, RoutingConfig, UpstreamConfig
from tests.gateway.test_upstream_prefill import answered, waiting_call
from tests.support.markers import marks_users
from tests.support.servers import free_port
from tests.support.waiting import wait_until
from tests.support import plain_http

NUM_BLOCKS = 48  # 16-token blocks: 768 tokens, so that a few prompts evict one another
WORDS = ("river", "lantern", "copper", "meadow", "harbour", "signal", "granite", "orchard", "violet", "thunder")


def system_prompt(seed: int, words: int = 90) -> str:
    """A system prompt of its own (about a token a word), sharing nothing with another seed's past its first token."""
    return f"Ledger {seed}. " + " ".join(WORDS[(seed * 7 + i * (seed + 3)) % len(WORDS)] for i in range(words))


class EventingEngine:
    """One `parrot engine` process (the tiny model) with its prefix cache's events published on a wildcard port
    (bound, as vLLM binds ``tcp://*:5557``) and a replay socket."""

    def __init__(self, model_dir: str):
        self.port, events, replay = free_port(), free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.events, self.replay = f"tcp://127.0.0.1:{events}", f"tcp://127.0.0.1:{replay}"
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.server.cli", "engine", "--port", str(self.port), "--model", model_dir,
             "--num-blocks", str(NUM_BLOCKS), "--num-threads", "1", "--log-level", "warning",
             "--kv-events-endpoint", f"tcp://*:{events}", "--kv-events-replay-endpoint", f"tcp://*:{replay}"],
            env={**os.environ, "HF_HUB_OFFLINE": "1"})

    def upstream(self, model: str, **fields) -> UpstreamConfig:
        return UpstreamConfig(model=model, base_url=f"{self.url}/v1", kv_events=self.events,
                              kv_events_replay=self.replay, **fields)

    def stats(self) -> dict:
        return plain_http.get(f"{self.url}/v1/stats", timeout=10).json()

    def chat(self, model: str, system: str, user: str, max_tokens: int = 4) -> str:
        """A request straight to the engine, as a client the gateway never sees."""
        reply = plain_http.post(f"{self.url}/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": max_tokens, "temperature": 0,
            "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]})
        assert reply.status_code == 200, reply.text
        return reply.json()["choices"][0]["message"]["content"]


@pytest.fixture(scope="module")
@marks_users("model", "subprocess")
def eventing_engines(tiny_model_dir) -> Iterator[list[EventingEngine]]:
    engines = [EventingEngine(str(tiny_model_dir)) for _ in range(2)]
    try:
        for engine in engines:
            wait_until(lambda: _ready(engine), timeout_s=180, interval_s=0.5)
        yield engines
    finally:
        for engine in engines:
            engine.process.terminate()
        for engine in engines:
            engine.process.wait(timeout=60)


def _ready(engine: EventingEngine) -> bool:
    assert engine.process.poll() is None, "the engine process exited"
    try:
        return plain_http.get(f"{engine.url}/v1/models", timeout=2).status_code == 200
    except httpx.TransportError:
        return False


def listed(http: httpx.Client, gateway: str) -> dict[str, dict]:
    """The gateway's engines by URL (its /v1/engines)."""
    return {e["url"].removesuffix("/v1"): e for e in http.get(f"{gateway}/v1/engines").json()}


@pytest.mark.timeout(300)
def test_the_gateways_view_of_each_engine_is_what_the_engine_holds(eventing_engines, tiny_model_dir, http,
                                                                  start_gateway):
    model = tiny_model_dir.name
    gateway = start_gateway([e.upstream(model) for e in eventing_engines])
    for seed in range(8):  # more than the two caches hold: blocks are evicted as well as stored
        reply = http.post(f"{gateway}/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system_prompt(seed)}, {"role": "user", "content": "Go on."}]})
        assert reply.status_code == 200, reply.text

    def same() -> bool:
        views = listed(http, gateway)
        return all(views[e.url]["held_prefix_tokens"] == e.stats()["cached_tokens"] > 0 for e in eventing_engines)

    wait_until(same, timeout_s=10)


@pytest.mark.timeout(300)
def test_a_request_goes_where_its_prefix_was_computed_even_by_another_client(eventing_engines, tiny_model_dir,
                                                                             http, start_gateway):
    model = tiny_model_dir.name
    gateway = start_gateway([e.upstream(model) for e in eventing_engines])
    ids = {url: e["id"] for url, e in listed(http, gateway).items()}
    for seed in range(20, 26):
        engine = eventing_engines[seed % 2]
        engine.chat(model, system_prompt(seed), "First question.")  # the gateway never saw this one
        wait_until(lambda: listed(http, gateway)[engine.url]["held_prefix_tokens"] > 0, timeout_s=10)
        hits = engine.stats()["prefix_hit_tokens"]
        reply = http.post(f"{gateway}/v1/chat/completions", timeout=120, json={
            "model": model, "max_tokens": 4, "temperature": 0,
            "messages": [{"role": "system", "content": system_prompt(seed)},
                         {"role": "user", "content": "Second question."}]})
        assert reply.status_code == 200, reply.text
        assert reply.headers["x-parrot-engine"] == ids[engine.url], seed
        assert engine.stats()["prefix_hit_tokens"] - hits >= 80  # its system prompt (~100 tokens), from the cache


@pytest.mark.timeout(300)
def test_a_waiting_calls_prefix_evicted_before_its_input_is_prefilled_again(eventing_engines, tiny_model_dir, http,
                                                                          start_gateway):
    model = tiny_model_dir.name
    engine = eventing_engines[0]
    gateway = start_gateway([engine.upstream(model, prefill_ahead=True)],
                            routing=RoutingConfig(health_check_interval_s=0.2), kv_events=KVEventsConfig())
    system = system_prompt(40, words=250)  # ~265 tokens
    wait_until(lambda: engine.stats()["blocks_total"] and http.get(f"{gateway}/v1/engines").json(), timeout_s=10)
    engine.chat(model, system_prompt(41), "Start.")  # so the gateway's stream has heard from the engine
    wait_until(lambda: listed(http, gateway)[engine.url]["held_prefix_tokens"] > 0, timeout_s=10)

    before = engine.stats()["prompt_tokens"]
    var, output = waiting_call(http, gateway, system, model=model)
    wait_until(lambda: prefills(http, gateway) == 1 and engine.stats()["prompt_tokens"] > before, timeout_s=30)
    warmed = engine.stats()["prompt_tokens"]
    assert warmed - before >= 200  # the system prompt and the template around it

    # Other clients' prompts, straight to the engine, ~170 tokens (11 blocks) each: 44 blocks of its 48, so its LRU
    # evicts the warmed prefix (17 blocks) once, and what it evicts after that is older than the prefix prefilled again.
    for seed in range(42, 46):
        engine.chat(model, system_prompt(seed, words=150), "Next.")
    wait_until(lambda: prefills(http, gateway) >= 2, timeout_s=30)  # evicted: prefilled again
    wait_until(lambda: engine.stats()["prompt_tokens"] - warmed >= 4 * 150 + 250, timeout_s=30)  # and computed

    hits = engine.stats()["prefix_hit_tokens"]
    text = answered(http, gateway, var, "What is in the ledger?", output)
    assert engine.stats()["prefix_hit_tokens"] - hits >= 200  # the call found its prefix cached
    assert prefills(http, gateway) == 2  # no re-warm once the input came
    plain = engine.chat(model, system, "What is in the ledger?", max_tokens=16)
    assert text == plain  # greedy: the answer is the plain request's


def prefills(http: httpx.Client, gateway: str) -> int:
    found = re.findall(r"^parrot:prefill_ahead_total{.*} (\S+)$", http.get(f"{gateway}/metrics").text, re.M)
    return int(sum(float(v) for v in found))
