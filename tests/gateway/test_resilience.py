"""Upstream resilience: retries (backoff, retry-after), circuit breakers, active health checks,
fallback models and the upstream API key, against small scripted upstreams on loopback."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import msgspec
import pytest

from tests.support import fake_upstream
from gateway.config import GatewayConfig, LimitsConfig, RoutingConfig, UpstreamConfig, load_config
from tests.support.servers import asgi_app, free_port, read_asgi_body
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hello"}]}
QUICK = RoutingConfig(retry_backoff_s=0.01, health_check_interval_s=0)  # retries without waiting long


class Scripted:
    """An upstream answering each request with the next step of its script, then 200s. A step is an
    HTTP status (with an OpenAI error body and ``headers``) or ``"stall"`` (answering after
    ``stall_s``). Counts the requests and keeps their authorization headers; GET /v1/models answers
    200 while ``healthy``."""

    def __init__(self, *steps: int | str, headers: dict[str, str] | None = None, stall_s: float = 1.0):
        self.steps = list(steps)
        self.headers = [(k.encode(), v.encode()) for k, v in (headers or {}).items()]
        self.stall_s = stall_s
        self.requests = 0
        self.healthy = True
        self.authorizations: list[str] = []
        self.app = asgi_app(self.handle)

    async def handle(self, scope, receive, send) -> None:
        self.authorizations.append(dict(scope["headers"]).get(b"authorization", b"").decode())
        if scope["method"] == "GET":
            status = 200 if self.healthy else 503
            return await self._send(send, status, {"object": "list", "data": []})
        body = await read_asgi_body(receive)
        request = msgspec.json.decode(body)
        self.requests += 1
        step = self.steps.pop(0) if self.steps else 200
        if step == "stall":
            await asyncio.sleep(self.stall_s)
        elif step != 200:
            error = {"error": {"message": f"scripted {step}", "type": "server_error", "param": None,
                               "code": "scripted"}}
            return await self._send(send, step, error, self.headers)
        if request.get("stream"):
            await send({"type": "http.response.start", "status": 200,
                        "headers": [(b"content-type", b"text/event-stream")]})
            events = b"".join(b"data: " + msgspec.json.encode(c) + b"\n\n" for c in fake_upstream.chunks(request))
            await send({"type": "http.response.body", "body": events + b"data: [DONE]\n\n"})
            return
        await self._send(send, 200, fake_upstream.completion(request))

    @staticmethod
    async def _send(send, status: int, payload: Any, headers: list[tuple[bytes, bytes]] = ()) -> None:
        data = msgspec.json.encode(payload)
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), *headers]})
        await send({"type": "http.response.body", "body": data})


@pytest.fixture
def upstream(serve):
    """``upstream(scripted, model=MODEL, **fields)``: serves ``scripted``; returns its UpstreamConfig."""

    def start(scripted: Scripted, model: str = MODEL, **fields: Any) -> UpstreamConfig:
        return UpstreamConfig(model=model, base_url=f"{serve(scripted.app)}/v1", **fields)

    return start


def answer(response) -> str:
    assert response.status_code == 200, response.text
    if response.headers["content-type"].startswith("text/event-stream"):
        assert response.text.endswith("data: [DONE]\n\n")
        return response.text
    return response.json()["choices"][0]["message"]["content"]


# ---------------------------------------------------------------- retries


def test_429_is_retried_after_its_retry_after(http, start_gateway, upstream):
    scripted = Scripted(429, headers={"retry-after": "1"})
    url = start_gateway([upstream(scripted)], routing=QUICK)

    started = time.monotonic()
    response = http.post(f"{url}/v1/chat/completions", json=CHAT)

    assert answer(response) == "echo: hello"
    assert scripted.requests == 2
    assert time.monotonic() - started >= 1.0  # it waited as asked, not the 10 ms backoff


def test_429_asking_longer_than_the_cap_is_passed_through(http, start_gateway, upstream):
    scripted = Scripted(429, headers={"retry-after": "30"})
    url = start_gateway([upstream(scripted)], routing=QUICK)

    response = http.post(f"{url}/v1/chat/completions", json=CHAT)

    assert response.status_code == 429
    assert response.json()["error"]["code"] == "scripted"
    assert response.headers["retry-after"] == "30"  # the engine's own pause request reaches the client
    assert scripted.requests == 1


@pytest.mark.parametrize("stream", [False, True])
def test_5xx_is_retried_before_anything_reached_the_client(http, start_gateway, upstream, stream):
    scripted = Scripted(503, 500)
    url = start_gateway([upstream(scripted)], routing=QUICK)

    response = http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream})

    assert "hello" in answer(response)
    assert scripted.requests == 3


def test_read_timeout_is_retried(http, start_gateway, upstream):
    scripted = Scripted("stall", stall_s=1.0)
    url = start_gateway([upstream(scripted)], limits=LimitsConfig(request_timeout_s=0.3), routing=QUICK)

    response = http.post(f"{url}/v1/chat/completions", json=CHAT)

    assert answer(response) == "echo: hello"
    assert scripted.requests == 2


def test_retries_are_bounded(http, start_gateway, upstream):
    scripted = Scripted(*[503] * 10)
    url = start_gateway([upstream(scripted)], routing=RoutingConfig(num_retries=3, retry_backoff_s=0.01,
                                                                    health_check_interval_s=0))

    response = http.post(f"{url}/v1/chat/completions", json=CHAT)

    assert response.status_code == 503
    assert response.json()["error"]["message"] == "scripted 503"  # the upstream's own error, passed through
    assert scripted.requests == 4


def test_no_retry_starts_past_the_deadline(http, start_gateway, upstream):
    scripted = Scripted(*[503] * 10)
    url = start_gateway([upstream(scripted)], routing=RoutingConfig(retry_backoff_s=0.5, retry_deadline_s=0.2,
                                                                    health_check_interval_s=0))

    assert http.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 503
    assert scripted.requests == 1


@pytest.mark.parametrize("stream", [False, True])
def test_client_errors_are_not_retried(http, start_gateway, upstream, stream):
    scripted = Scripted(400)
    url = start_gateway([upstream(scripted)], routing=QUICK)

    response = http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream})

    assert response.status_code == 400
    assert response.json()["error"]["message"] == "scripted 400"
    assert scripted.requests == 1


def test_a_retry_goes_to_another_engine_first(http, start_gateway, upstream):
    failing, working = Scripted(*[503] * 10), Scripted()
    url = start_gateway([upstream(failing), upstream(working)], routing=QUICK)

    for _ in range(4):
        assert answer(http.post(f"{url}/v1/chat/completions", json=CHAT)) == "echo: hello"

    # Every request that met the failing engine went straight on to the working one, once.
    assert working.requests == 4
    assert failing.requests >= 1


# ---------------------------------------------------------------- circuit breaker


def test_a_sole_upstream_that_failed_is_tried_again_on_the_next_request(http, start_gateway, serve):
    port = free_port()  # nothing listens there yet
    url = start_gateway([UpstreamConfig(model=MODEL, base_url=f"http://127.0.0.1:{port}/v1")],
                        routing=RoutingConfig(num_retries=0, breaker_failures=1, health_check_interval_s=0))

    assert http.post(f"{url}/v1/chat/completions", json=CHAT).status_code == 502
    serve(Scripted().app, port=port)  # it comes back

    assert answer(http.post(f"{url}/v1/chat/completions", json=CHAT)) == "echo: hello"


def test_an_unreachable_engine_is_a_502_that_does_not_show_its_address(http, start_gateway):
    """The engine's name, not where it listens: httpx's text ("cannot connect to 127.0.0.1:PORT")
    reached clients once."""
    port = free_port()  # nothing listens there
    url = start_gateway([UpstreamConfig(model=MODEL, base_url=f"http://127.0.0.1:{port}/v1", name="primary")],
                        routing=RoutingConfig(num_retries=0, health_check_interval_s=0))

    refused = http.post(f"{url}/v1/chat/completions", json=CHAT)

    assert refused.status_code == 502 and refused.json()["error"]["code"] == "upstream_unavailable"
    assert "primary" in refused.text and "127.0.0.1" not in refused.text and str(port) not in refused.text


def test_breaker_opens_after_failures_and_lets_one_probe_through_after_the_cooldown(
        http, start_gateway, upstream, wait_until):
    flaky, steady = Scripted(*[500] * 100), Scripted()
    url = start_gateway([upstream(flaky), upstream(steady)],
                        routing=RoutingConfig(breaker_failures=2, breaker_cooldown_s=1.0, retry_backoff_s=0.01,
                                              health_check_interval_s=0))

    def chat() -> bool:
        return answer(http.post(f"{url}/v1/chat/completions", json=CHAT)) == "echo: hello"

    wait_until(lambda: chat() and flaky.requests == 2, timeout_s=5)
    for _ in range(5):  # open: every request goes to the steady one
        chat()
    assert flaky.requests == 2
    flaky_healthy = {e["name"]: e["healthy"] for e in http.get(f"{url}/v1/engines").json()}["upstream-0"]
    assert flaky_healthy is False

    wait_until(lambda: chat() and flaky.requests == 3, timeout_s=5)  # after the cooldown: one probe...
    for _ in range(5):  # ...which failed: open again
        chat()
    assert flaky.requests == 3


# ---------------------------------------------------------------- health checks


def test_health_checks_take_an_upstream_out_and_back(http, start_gateway, upstream, wait_until):
    scripted = Scripted()
    url = start_gateway([upstream(scripted)], routing=RoutingConfig(health_check_interval_s=0.1))

    def healthy() -> bool:
        return http.get(f"{url}/v1/engines").json()[0]["healthy"]

    wait_until(lambda: scripted.authorizations)  # checked at once
    assert healthy()
    scripted.healthy = False
    wait_until(lambda: not healthy())
    assert http.get(f"{url}/health").status_code == 503
    scripted.healthy = True
    wait_until(healthy)
    assert http.get(f"{url}/health").status_code == 200


# ---------------------------------------------------------------- fallbacks


@pytest.mark.parametrize("stream", [False, True])
def test_fallback_model_serves_when_every_engine_of_the_asked_one_failed(http, start_gateway, upstream, fake_url,
                                                                         stream):
    broken = Scripted(*[503] * 10)
    url = start_gateway([upstream(broken, model="big"), UpstreamConfig(model="small", base_url=f"{fake_url}/v1")],
                        routing=RoutingConfig(num_retries=1, retry_backoff_s=0.01, health_check_interval_s=0,
                                              fallbacks={"big": ["missing", "small"]}))

    response = http.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "big", "stream": stream})

    assert "hello" in answer(response)
    assert '"model":"small"' in response.text  # the model that served, as the engine reported it
    assert broken.requests == 2


def test_fallbacks_are_not_taken_on_client_errors(http, start_gateway, upstream, fake_url, fake_stats):
    before = fake_stats()["requests"]
    url = start_gateway([upstream(Scripted(400), model="big"), UpstreamConfig(model="small",
                                                                              base_url=f"{fake_url}/v1")],
                        routing=RoutingConfig(health_check_interval_s=0, fallbacks={"big": ["small"]}))

    assert http.post(f"{url}/v1/chat/completions", json={**CHAT, "model": "big"}).status_code == 400
    assert fake_stats()["requests"] == before


def test_routing_config_from_toml(tmp_path):
    path = tmp_path / "parrot.toml"
    path.write_text('[routing]\nnum_retries = 4\nfallbacks = {"gpt-4o" = ["gpt-4o-mini"]}\n')

    routing = load_config(path, env={"PARROT_HEALTH_CHECK_INTERVAL_S": "0"}).routing

    assert (routing.num_retries, routing.fallbacks, routing.health_check_interval_s) == (
        4, {"gpt-4o": ["gpt-4o-mini"]}, 0)
    assert GatewayConfig().routing.num_retries == 2
    with pytest.raises(msgspec.ValidationError, match="num_retries"):
        msgspec.convert({"routing": {"num_retries": -1}}, GatewayConfig)


# ---------------------------------------------------------------- the upstream's API key


def test_upstream_gets_the_key_from_api_key_env_which_is_never_shown(http, start_gateway, upstream, monkeypatch,
                                                                     caplog, wait_until):
    key = "sk-test-0123456789abcdef"
    monkeypatch.setenv("PARROT_TEST_UPSTREAM_KEY", key)
    scripted = Scripted(503)  # a failure, so that something is logged about it
    url = start_gateway([upstream(scripted, api_key_env="PARROT_TEST_UPSTREAM_KEY", name="keyed")],
                        routing=RoutingConfig(retry_backoff_s=0.01, health_check_interval_s=0.1))

    assert answer(http.post(f"{url}/v1/chat/completions", json=CHAT)) == "echo: hello"
    wait_until(lambda: len(scripted.authorizations) >= 3)  # two completions and a health check

    assert set(scripted.authorizations) == {f"Bearer {key}"}
    listed = http.get(f"{url}/v1/engines")
    assert listed.status_code == 200 and "keyed" in listed.text and key not in listed.text
    # The gateway's log (it runs in this process, its records caught here).
    wait_until(lambda: "engine 'keyed' answered HTTP 503" in caplog.text)
    assert key not in caplog.text
