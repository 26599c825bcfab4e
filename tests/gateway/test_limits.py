"""Request limits that hold: a request without max_tokens still ends, n × max_tokens is capped, priority
is bounded, variable reads wait a bounded time, and an open gateway keeps keys' sessions apart.

The gateway's side runs against the fake upstream (which records the last body it got); what only the
builtin engine does (the room left in its context window) runs against the real SmolLM2 engine.
"""

from __future__ import annotations

import time

import httpx
import pytest

from gateway.server.app import create_app
from gateway.config import BuiltinConfig, EnginesConfig, GatewayConfig, LimitsConfig, SemanticConfig
from tests.support.models import SMOLLM
from tests.support.fake_upstream import MODEL
from tests.support import plain_http

CAP = 64


def chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "hello"}], **extra}


@pytest.fixture
def capped(start_gateway) -> httpx.Client:
    """A gateway in front of the fake upstream with [limits] max_tokens = CAP."""
    with httpx.Client(base_url=start_gateway(limits=LimitsConfig(max_tokens=CAP)), timeout=20) as client:
        yield client


def sent_max_tokens(fake_stats) -> int | None:
    return fake_stats()["last_body"].get("max_tokens")


# ---------------------------------------------------------------- max_tokens defaults (gateway side)


def test_chat_without_max_tokens_is_held_to_the_cap_upstream(capped, fake_stats):
    assert capped.post("/v1/chat/completions", json=chat()).status_code == 200
    assert sent_max_tokens(fake_stats) == CAP

    assert capped.post("/v1/chat/completions", json=chat(stream=True)).status_code == 200
    assert sent_max_tokens(fake_stats) == CAP

    assert capped.post("/v1/chat/completions", json=chat(max_completion_tokens=5)).status_code == 200
    assert sent_max_tokens(fake_stats) is None  # the client's own limit is sent as it is


def test_legacy_completion_without_max_tokens_gets_16_as_on_openai(gateway_url, http, fake_stats):
    response = http.post(f"{gateway_url}/v1/completions", json={"model": MODEL, "prompt": "Hello"})

    assert response.status_code == 200
    assert sent_max_tokens(fake_stats) == 16


def test_choices_without_max_tokens_share_the_per_request_cap(capped, fake_stats):
    assert capped.post("/v1/chat/completions", json=chat(n=4)).status_code == 200
    assert sent_max_tokens(fake_stats) == CAP // 4


def test_semantic_outputs_without_max_tokens_are_bounded(capped, fake_stats):
    queued = capped.post("/v1/chat/completions", json=chat(parrot={"wait": False}))
    assert queued.status_code == 202
    output = queued.json()["parrot"]["output"]["id"]
    assert capped.get(f"/v1/vars/{output}", params={"wait": "true", "timeout": 10}).json()["ready"]
    assert sent_max_tokens(fake_stats) == CAP

    call = capped.post("/v1/semantic_calls", json={"model": MODEL, "template": "Say {{output:x}}"})
    assert call.status_code == 202
    output = call.json()["outputs"]["x"]["id"]
    assert capped.get(f"/v1/vars/{output}", params={"wait": "true", "timeout": 10}).json()["ready"]
    assert sent_max_tokens(fake_stats) == 16  # semantic call outputs run as legacy completions


# ---------------------------------------------------------------- n × max_tokens, priority


@pytest.mark.parametrize(("body", "param"), [
    (chat(n=128, max_tokens=CAP), "n"),
    (chat(n=CAP + 1), "n"),  # without max_tokens each choice still makes a token
    (chat(max_tokens=CAP + 1), "max_tokens"),
    ({"model": MODEL, "prompt": ["a", "b", "c"], "max_tokens": CAP // 2}, "prompt"),
])
def test_requests_generating_more_than_the_cap_are_refused(capped, body, param):
    route = "/v1/completions" if "prompt" in body else "/v1/chat/completions"

    response = capped.post(route, json=body)

    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param


def test_max_request_tokens_caps_all_choices_together(start_gateway):
    url = start_gateway(limits=LimitsConfig(max_tokens=CAP, max_request_tokens=100))
    with httpx.Client(base_url=url, timeout=20) as gw:
        assert gw.post("/v1/chat/completions", json=chat(n=2, max_tokens=50)).status_code == 200
        refused = gw.post("/v1/chat/completions", json=chat(n=2, max_tokens=51))
        assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
        semantic = gw.post("/v1/semantic_calls", json={"model": MODEL, "template": "{{output:x}}",
                                                       "outputs": {"x": {"max_tokens": CAP + 1}}})
        assert semantic.status_code == 400 and semantic.json()["error"]["param"] == "outputs.x.max_tokens"


@pytest.mark.parametrize("priority", [10**30, 2**31, -(2**31) - 1])
def test_priority_beyond_32_bits_is_refused(gateway_url, http, priority):
    response = http.post(f"{gateway_url}/v1/chat/completions", json=chat(priority=priority))

    assert response.status_code == 400
    assert "priority" in response.json()["error"]["message"]


def test_the_gateways_own_priorities_stay_valid(gateway_url, http):
    for priority in (1 << 20, -(1 << 20)):  # gateway/semantic/graph.py's LATENCY_PRIORITY and app-FIFO ranks
        assert http.post(f"{gateway_url}/v1/chat/completions", json=chat(priority=priority)).status_code == 200


# ---------------------------------------------------------------- bounded waits


def test_an_endless_variable_wait_ends_at_the_configured_maximum(start_gateway):
    url = start_gateway(semantic=SemanticConfig(max_var_wait_s=0.5))
    with httpx.Client(base_url=url, timeout=20) as gw:
        var = gw.post("/v1/vars", json={"name": "never"}).json()["id"]
        started = time.monotonic()
        response = gw.get(f"/v1/vars/{var}", params={"wait": "true", "timeout": "inf"})
        assert response.status_code == 504 and response.json()["error"]["code"] == "variable_timeout"
        assert time.monotonic() - started < 5
        assert gw.get(f"/v1/vars/{var}", params={"wait": "true", "timeout": "nan"}).status_code == 400


# ---------------------------------------------------------------- open gateway: sessions by key


def test_an_open_gateway_keeps_each_keys_sessions_apart(gateway_url, http):
    alice, bob = ({"authorization": f"Bearer {key}"} for key in ("sk-alice", "sk-bob"))
    session = http.post(f"{gateway_url}/v1/sessions", headers=alice).json()["id"]
    var = http.post(f"{gateway_url}/v1/vars", headers=alice, json={"session_id": session, "value": "secret"}).json()

    assert http.get(f"{gateway_url}/v1/sessions/{session}/vars", headers=alice).status_code == 200
    for other in (bob, {}):
        assert http.get(f"{gateway_url}/v1/sessions/{session}/vars", headers=other).status_code == 404
        assert http.get(f"{gateway_url}/v1/vars/{var['id']}", headers=other).status_code == 404
        assert http.delete(f"{gateway_url}/v1/sessions/{session}", headers=other).status_code == 404
    anonymous = http.post(f"{gateway_url}/v1/sessions").json()["id"]
    assert http.get(f"{gateway_url}/v1/sessions/{anonymous}/vars").status_code == 200  # keyless requests share one
    assert http.get(f"{gateway_url}/v1/sessions/{anonymous}/vars", headers=bob).status_code == 404
    http.delete(f"{gateway_url}/v1/sessions/{session}", headers=alice)
    http.delete(f"{gateway_url}/v1/sessions/{anonymous}")


# ---------------------------------------------------------------- on the builtin engine

ENGINE_CAP = 8
SYSTEM = ("You are a patient assistant for a public library. Answer in full sentences and explain every step "
          "of your reasoning at length.")


@pytest.fixture(scope="module")
def builtin_capped(smollm_gateway, serve_module) -> str:
    """A gateway with [limits] max_tokens = ENGINE_CAP, the real SmolLM2 engine registered with it."""
    secret = smollm_gateway["secret"]
    url = serve_module(create_app(GatewayConfig(
        builtin=BuiltinConfig(enabled=False), limits=LimitsConfig(max_tokens=ENGINE_CAP),
        engines=EnginesConfig(registration_secret=secret, heartbeat_timeout_s=3600.0))))
    registered = plain_http.post(f"{url}/v1/engines", headers={"authorization": f"Bearer {secret}"}, json={
        "name": "smollm", "url": smollm_gateway["engine"], "models": [SMOLLM], "capabilities": ["contexts", "scheduling_hints"]})
    assert registered.status_code == 201, registered.text
    return url


def test_a_builtin_stream_without_max_tokens_stops_at_the_cap(builtin_capped):
    body = {"model": SMOLLM, "messages": [{"role": "user", "content": "Tell me a long story."}], "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    with plain_http.stream("POST", f"{builtin_capped}/v1/chat/completions", json=body, timeout=120) as response:
        events = [line[6:] for line in response.iter_lines() if line.startswith("data: {")]

    assert response.status_code == 200
    chunks = [httpx.Response(200, content=event).json() for event in events]
    assert chunks[-1]["usage"]["completion_tokens"] == ENGINE_CAP
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]][-1] == "length"


def test_a_builtin_legacy_completion_without_max_tokens_makes_16_tokens(smollm_gateway):
    response = plain_http.post(f"{smollm_gateway['gateway']}/v1/completions", timeout=120,
                          json={"model": SMOLLM, "prompt": "Hello", "ignore_eos": True})

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == 16
    assert response.json()["choices"][0]["finish_reason"] == "length"


def test_a_builtin_semantic_output_without_max_tokens_stops_at_the_cap(builtin_capped):
    body = {"model": SMOLLM, "ignore_eos": True, "parrot": {"vars": {"q": {"value": "Why is the sky blue?"}}},
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "{{q}}"}]}

    response = plain_http.post(f"{builtin_capped}/v1/chat/completions", json=body, timeout=120)

    assert response.status_code == 200, response.text
    assert response.json()["usage"]["completion_tokens"] == ENGINE_CAP
    assert response.json()["choices"][0]["finish_reason"] == "length"
