"""What a key holds between its requests, against its quotas: calls that wait (wait=false, on inputs nobody
may ever produce) and the shared prefixes the gateway fills on the engine ahead of them. Real gateway and
builtin engine (a tiny random Llama) on loopback, two keys."""

from __future__ import annotations

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from engines.builtin.config import EngineConfig
from engines.builtin.server.app import create_app as create_engine_app
from gateway.server.app import create_app as create_gateway_app
from gateway.config import AuthConfig, BuiltinConfig, EnginesConfig, GatewayConfig, QuotasConfig, SemanticConfig
from tests.support.waiting import wait_until
from tests.support import plain_http

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = pytest.mark.model

MODEL = "tiny"
ALICE, BOB = "sk-alice", "sk-bob"
# A system prompt of ~300 bytes: about 75 tokens as the gateway estimates them; Alice may hold one ahead.
PINNED_QUOTA = 100


def system(topic: str) -> str:
    return (f"You are the assistant of a small museum, answering visitors' questions about {topic}. " * 4)[:300]


def engine_and_gateway(serve, tiny_model_dir, **sections) -> str:
    """A tiny engine and a keyed gateway it is registered with; returns the gateway's URL."""
    engine = serve(create_engine_app(EngineConfig(model=str(tiny_model_dir), num_blocks=128), model_name=MODEL))
    url = serve(create_gateway_app(GatewayConfig(
        builtin=BuiltinConfig(enabled=False), auth=AuthConfig(api_keys=[ALICE, BOB]),
        engines=EnginesConfig(registration_secret="s", heartbeat_timeout_s=600.0), **sections)))
    registered = plain_http.post(f"{url}/v1/engines", json={"name": MODEL, "url": engine, "models": [MODEL]},
                            headers={"authorization": "Bearer s"})
    assert registered.status_code == 201, registered.text
    return url


@pytest.fixture
def gateway(serve, tiny_model_dir) -> str:
    return engine_and_gateway(serve, tiny_model_dir,
                              quotas=QuotasConfig(keys={ALICE: {"pinned_prefix_tokens": PINNED_QUOTA}}))


def metric(client: httpx.Client, name: str) -> float:
    return sum(sample.value for family in text_string_to_metric_families(client.get("/metrics").text)
               for sample in family.samples if sample.name == name)


def wait_on_nothing(client: httpx.Client, session: str, topic: str) -> None:
    """A call whose one input nobody produces, queued: the gateway fills its prefix ahead if it may."""
    never = client.post("/v1/vars", json={"session_id": session, "name": "m"}).json()["id"]
    queued = client.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": system(topic)},
                                                      {"role": "user", "content": "{{m}}"}],
        "parrot": {"session_id": session, "wait": False, "vars": {"m": {"id": never}}}})
    assert queued.status_code == 202, queued.text


@pytest.mark.timeout(300)
def test_prefixes_held_ahead_of_waiting_calls_count_against_their_keys_pinned_tokens(gateway):
    """The probe pinned 45 prefixes with calls that never run; now a key holds at most its quota of them, and
    another key's calls are not refused for it. A call over its key's quota still runs: it fills at its run."""
    alice = httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {ALICE}"}, timeout=60)
    bob = httpx.Client(base_url=gateway, headers={"authorization": f"Bearer {BOB}"}, timeout=60)
    alices, bobs = alice.post("/v1/sessions").json()["id"], bob.post("/v1/sessions").json()["id"]

    wait_on_nothing(alice, alices, "fossils")
    first = wait_until(lambda: metric(alice, "parrot:pinned_prefix_tokens"), timeout_s=30)
    assert 0 < first <= PINNED_QUOTA
    wait_on_nothing(alice, alices, "the building")  # a second prefix would take Alice over her quota
    wait_until(lambda: metric(alice, "parrot:prefix_pins_refused_total") == 1, timeout_s=30)
    wait_on_nothing(bob, bobs, "birds")
    wait_until(lambda: metric(bob, "parrot:pinned_prefix_tokens") > first, timeout_s=30)

    assert metric(alice, "parrot:prefix_pins_refused_total") == 1
    [engine] = alice.get("/v1/engines").json()
    assert engine["prefix_contexts"] == 2  # Alice's first and Bob's
    for client, session in ((alice, alices), (bob, bobs)):
        assert client.delete(f"/v1/sessions/{session}").status_code == 200
    wait_until(lambda: metric(alice, "parrot:pinned_prefix_tokens") == 0, timeout_s=30)


@pytest.mark.timeout(300)
def test_a_call_whose_input_never_comes_says_how_long_it_waited(serve, tiny_model_dir):
    """Its wait on the engine ahead of its input counted against the same timeout, and the message said
    "within 0s" (what was left of it)."""
    url = engine_and_gateway(serve, tiny_model_dir, semantic=SemanticConfig(input_timeout_s=1.5))
    alice = httpx.Client(base_url=url, headers={"authorization": f"Bearer {ALICE}"}, timeout=60)
    never = alice.post("/v1/vars", json={"name": "m"}).json()["id"]
    answer = alice.post("/v1/chat/completions", json={
        "model": MODEL, "max_tokens": 4, "messages": [{"role": "system", "content": system("maps")},
                                                      {"role": "user", "content": "{{m}}"}],
        "parrot": {"vars": {"m": {"id": never}}}})

    assert answer.status_code == 504, answer.text
    assert "was not ready within 1.5s: nothing produces it" in answer.json()["error"]["message"]
