"""Routing across engines: load spread, engines registering and heartbeating, and the metrics they feed."""

from __future__ import annotations

import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support import fake_upstream
from gateway.config import EnginesConfig, UpstreamConfig
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve

MESSAGES = [{"role": "user", "content": "hello"}]


def chat(http: httpx.Client, url: str, model: str = MODEL, **fields) -> httpx.Response:
    return http.post(f"{url}/v1/chat/completions", json={"model": model, "messages": MESSAGES, **fields})


def test_load_spreads_over_upstreams_of_one_model(http, start_gateway, serve, fake_url):
    other_fake_url = serve(fake_upstream.app)
    # The fake echoes the model it was sent, so the upstream_model names tell which upstream answered.
    url = start_gateway([UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1", upstream_model="first"),
                         UpstreamConfig(model=MODEL, base_url=f"{other_fake_url}/v1", upstream_model="second")])

    answered_by = [chat(http, url).json()["model"] for _ in range(20)]

    assert set(answered_by) == {"first", "second"}
    assert min(answered_by.count("first"), answered_by.count("second")) >= 5


# ---------------------------------------------------------------- registration and heartbeats


SECRET = "engine-secret"  # the gateway's [engines] registration_secret


HEARTBEAT_TIMEOUT_S = 2.0  # short, so that a silent engine goes soon; long beside one chat on a loaded machine


@pytest.fixture
def engine_gateway(start_gateway) -> str:
    """A gateway with no static upstream, where engines register themselves and go stale quickly."""
    return start_gateway([], engines=EnginesConfig(registration_secret=SECRET, heartbeat_timeout_s=HEARTBEAT_TIMEOUT_S))


class Registered:
    """An engine's registration: its id, and the token it heartbeats with."""

    def __init__(self, id: str, token: str):
        self.id, self.token = id, token


def register(http: httpx.Client, gateway: str, engine_url: str, models: list[str], name: str = "engine-a"
             ) -> Registered:
    response = http.post(f"{gateway}/v1/engines", json={"name": name, "url": engine_url, "models": models},
                         headers={"authorization": f"Bearer {SECRET}"})
    assert response.status_code == 201, response.text
    return Registered(**response.json())


def heartbeat(http: httpx.Client, gateway: str, engine: Registered | str, token: str | None = None,
              **stats) -> httpx.Response:
    """A heartbeat for ``engine`` (its id, or its registration), with its own token unless ``token``."""
    engine_id = engine if isinstance(engine, str) else engine.id
    token = token if token is not None else getattr(engine, "token", "")
    return http.post(f"{gateway}/v1/engines/{engine_id}/heartbeat", json=stats,
                     headers={"authorization": f"Bearer {token}"})


def engines(http: httpx.Client, gateway: str) -> dict[str, dict]:
    return {e["id"]: e for e in http.get(f"{gateway}/v1/engines").json()}


def test_registered_engine_serves_its_models(http, engine_gateway, fake_url):
    assert chat(http, engine_gateway, "remote-model").status_code == 404

    engine_id = register(http, engine_gateway, fake_url, ["remote-model"]).id

    listed = engines(http, engine_gateway)
    assert list(listed) == [engine_id]
    assert listed[engine_id] | {"stats": None} == {
        "id": engine_id, "name": "engine-a", "capabilities": ["contexts", "scheduling_hints"], "url": fake_url, "models": ["remote-model"],
        "healthy": True, "in_flight": 0, "load": 0, "kv_use": 0.0, "held_prefix_tokens": 0, "prefix_contexts": 0,
        "prefix_hit_rate": 0.0, "requests_per_s": 0.0, "requests_total": 0, "stats": None, "pid": None}
    assert http.get(f"{engine_gateway}/v1/models").json()["data"][0]["id"] == "remote-model"
    reply = chat(http, engine_gateway, "remote-model")
    assert reply.status_code == 200
    assert reply.json()["choices"][0]["message"]["content"] == "echo: hello"


def test_heartbeat_updates_stats_and_unknown_engine_is_404(http, engine_gateway, fake_url):
    engine = register(http, engine_gateway, fake_url, ["remote-model"])

    response = heartbeat(http, engine_gateway, engine, running=2, waiting=1, prefix_hit_tokens=7)
    unknown = heartbeat(http, engine_gateway, "eng-0000000000000000", engine.token)

    assert response.status_code == 200
    assert response.json() == {"id": engine.id}
    stats = engines(http, engine_gateway)[engine.id]["stats"]
    assert (stats["running"], stats["waiting"], stats["prefix_hit_tokens"]) == (2, 1, 7)
    assert unknown.status_code == 404
    assert unknown.json()["error"]["code"] == "engine_not_found"
    assert "parrot:prefix_cache_hit_tokens 7.0" in http.get(f"{engine_gateway}/metrics").text


def test_silent_engine_is_removed_and_may_register_again(http, engine_gateway, fake_url, wait_until):
    engine = register(http, engine_gateway, fake_url, ["remote-model"])

    # Heartbeats keep it routable well past the timeout (a heartbeat before each chat: on a loaded machine one
    # chat may take most of a second)...
    until = time.monotonic() + 1.5 * HEARTBEAT_TIMEOUT_S
    while time.monotonic() < until:
        assert heartbeat(http, engine_gateway, engine).status_code == 200
        assert chat(http, engine_gateway, "remote-model").status_code == 200
        time.sleep(0.1)
    # ...and silence removes it: no longer listed, its model no longer served, its URL free again.
    wait_until(lambda: engine.id not in engines(http, engine_gateway), timeout_s=5 * HEARTBEAT_TIMEOUT_S)
    assert chat(http, engine_gateway, "remote-model").status_code == 404
    assert http.get(f"{engine_gateway}/health").status_code == 503
    late = heartbeat(http, engine_gateway, engine)
    assert late.status_code == 404 and late.json()["error"]["code"] == "engine_not_found"

    again = register(http, engine_gateway, fake_url, ["remote-model"])
    assert again.id != engine.id
    assert chat(http, engine_gateway, "remote-model").status_code == 200


def test_deregistered_engine_leaves_at_once(http, engine_gateway, fake_url):
    engine = register(http, engine_gateway, fake_url, ["remote-model"])

    left = http.delete(f"{engine_gateway}/v1/engines/{engine.id}", headers={"authorization": f"Bearer {engine.token}"})

    assert left.status_code == 200
    assert engines(http, engine_gateway) == {}
    assert register(http, engine_gateway, fake_url, ["remote-model"]).id != engine.id  # its URL is free


def test_malformed_registration_is_a_400(http, engine_gateway):
    response = http.post(f"{engine_gateway}/v1/engines", json={"name": "x", "models": ["m"]},
                         headers={"authorization": f"Bearer {SECRET}"})

    assert response.status_code == 400
    assert set(response.json()["error"]) == {"message", "type", "param", "code"}


# ---------------------------------------------------------------- metrics


def scrape(http: httpx.Client, gateway: str) -> dict[tuple[str, tuple], float]:
    """Every sample on /metrics as {(name, sorted labels): value}."""
    text = http.get(f"{gateway}/metrics").text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_count_requests_and_tokens(http, start_gateway):
    url = start_gateway()
    label = (("model_name", MODEL),)
    on_engine = (("engine", "upstream-0"), *label)  # the engine's name: configured upstreams are upstream-N

    longer = [{"role": "user", "content": "a longer prompt here"}]
    replies = [chat(http, url).json(), chat(http, url, messages=longer).json()]
    with http.stream("POST", f"{url}/v1/chat/completions",
                      json={"model": MODEL, "messages": MESSAGES, "stream": True,
                            "stream_options": {"include_usage": True}}) as streamed:
        streamed.read()
    assert chat(http, url, fake={"status": 429}).status_code == 429
    metrics = scrape(http, url)

    streamed_usage = fake_upstream.chunks({"messages": MESSAGES, "stream_options": {"include_usage": True}})[-1]
    usages = [r["usage"] for r in replies] + [streamed_usage["usage"]]
    assert metrics[("parrot:prompt_tokens_total", on_engine)] == sum(u["prompt_tokens"] for u in usages) > 0
    assert metrics[("parrot:generation_tokens_total", on_engine)] == sum(u["completion_tokens"] for u in usages) > 0
    assert metrics[("parrot:request_success_total", (("finished_reason", "stop"), *label))] == 3
    assert metrics[("parrot:request_errors_total", (("model_name", MODEL), ("status", "429")))] == 1
    assert metrics[("parrot:e2e_request_latency_seconds_count", on_engine)] == 3
    assert metrics[("parrot:request_queue_time_seconds_count", on_engine)] == 3
    assert metrics[("parrot:time_to_first_token_seconds_count", on_engine)] == 1
    assert metrics[("parrot:num_requests_running", on_engine)] == 0
    assert metrics[("parrot:engines_healthy", label)] == 1


def test_streamed_usage_and_finish_reasons_are_counted_wherever_they_sit_in_a_read():
    from wire.sse import sse_event
    from gateway.config import GatewayConfig
    from gateway.metrics import GatewayMetrics
    from gateway.registry import EngineRegistry
    from gateway.service import Gateway

    gateway = Gateway(GatewayConfig(), EngineRegistry(), GatewayMetrics(), client=None)
    measured = gateway.metrics.on(MODEL, "engine-a")
    delta = b'{"choices":[{"index":0,"delta":{"content":"hi"},"finish_reason":null}]}'
    stop = b'{"choices":[{"index":0,"delta":{},"finish_reason":"stop"}]}'
    usage = b'{"choices":[],"usage":{"prompt_tokens":5,"completion_tokens":2,"total_tokens":7}}'

    assert gateway.outcomes.count_events(measured, sse_event(delta) * 3) == []
    assert gateway.outcomes.count_events(measured, sse_event(stop)) == ["stop"]  # the marked event opens the read
    assert gateway.outcomes.count_events(measured, sse_event(delta) * 2 + sse_event(stop) + sse_event(usage)) == ["stop"]
    families = {s.name: s.value for f in text_string_to_metric_families(gateway.metrics.render().decode())
                for s in f.samples}
    assert families["parrot:prompt_tokens_total"] == 5 and families["parrot:generation_tokens_total"] == 2
