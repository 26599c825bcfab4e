"""Engine trust: only holders of the engine secret register engines, each engine speaks only for
itself, and no one takes another engine's place. The "attacker" is a real server on loopback that
would answer chat requests if the gateway ever routed one to it."""

from __future__ import annotations

import json

import httpx
import pytest

from engines.builtin.config import EngineConfig
from engines.builtin.http_app import GatewayRegistration, create_app as create_engine_app
from gateway.config import AuthConfig, EnginesConfig
from tests.support.servers import asgi_app
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve

SECRET = "engine-secret"
CLIENT_KEY = "client-key"
MESSAGES = [{"role": "user", "content": "hello"}]
STEAL = {"name": "thief", "models": [MODEL], "kind": "builtin"}


def bearer(credential: str) -> dict[str, str]:
    return {"authorization": f"Bearer {credential}"}


@pytest.fixture
def attacker(serve) -> tuple[str, list[str]]:
    """A would-be engine that records every request it receives (and answers like an engine)."""
    seen: list[str] = []

    async def handler(scope, receive, send):
        seen.append(f"{scope['method']} {scope['path']}")
        body = json.dumps({"id": "stolen", "object": "chat.completion", "model": MODEL, "choices": [
            {"index": 0, "message": {"role": "assistant", "content": "mine"}, "finish_reason": "stop"}]}).encode()
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return serve(asgi_app(handler)), seen


@pytest.fixture
def secured(start_gateway, fake_url) -> str:
    """A gateway with client keys and an engine secret, serving MODEL from the fake upstream."""
    return start_gateway(auth=AuthConfig(api_keys=[CLIENT_KEY]),
                         engines=EnginesConfig(registration_secret=SECRET, heartbeat_timeout_s=60.0))


def register(http: httpx.Client, gateway: str, url: str, credential: str = SECRET, **fields) -> httpx.Response:
    return http.post(f"{gateway}/v1/engines", json={**STEAL, "url": url, **fields}, headers=bearer(credential))


def chat_answers(http: httpx.Client, gateway: str, headers: dict[str, str], times: int = 8) -> list[str]:
    replies = [http.post(f"{gateway}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                         headers=headers) for _ in range(times)]
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies]
    return [r.json()["choices"][0]["message"]["content"] for r in replies]


def test_a_client_key_cannot_register_an_engine(http, secured, attacker):
    attacker_url, seen = attacker

    with_client_key = register(http, secured, attacker_url, CLIENT_KEY, kind="builtin")
    without_key = http.post(f"{secured}/v1/engines", json={**STEAL, "url": attacker_url})

    assert with_client_key.status_code == 401
    assert with_client_key.json()["error"]["code"] == "invalid_engine_secret"
    assert set(with_client_key.json()["error"]) == {"message", "type", "param", "code"}
    assert without_key.status_code == 401
    assert chat_answers(http, secured, bearer(CLIENT_KEY)) == ["echo: hello"] * 8
    assert seen == []
    listed = http.get(f"{secured}/v1/engines", headers=bearer(CLIENT_KEY)).json()
    assert [e["name"] for e in listed] == ["upstream-0"]


def test_an_open_gateway_without_a_secret_refuses_every_registration(http, start_gateway, attacker):
    gateway = start_gateway()  # no client keys, no engine secret
    attacker_url, seen = attacker

    as_json = http.post(f"{gateway}/v1/engines", json={**STEAL, "url": attacker_url})
    # What a cross-site page can send without a preflight: a form or text/plain body.
    as_form = http.post(f"{gateway}/v1/engines", data={"name": "thief", "url": attacker_url, "models": MODEL})
    as_text = http.post(f"{gateway}/v1/engines", content=json.dumps({**STEAL, "url": attacker_url}),
                        headers={"content-type": "text/plain"})

    assert [r.status_code for r in (as_json, as_form, as_text)] == [403, 403, 403]
    assert as_json.json()["error"]["code"] == "engine_registration_disabled"
    assert chat_answers(http, gateway, {}) == ["echo: hello"] * 8
    assert seen == []


def test_registration_takes_json_only(http, secured, attacker):
    attacker_url, _ = attacker
    as_text = http.post(f"{secured}/v1/engines", content=json.dumps({**STEAL, "url": attacker_url}),
                        headers={**bearer(SECRET), "content-type": "text/plain"})
    as_form = http.post(f"{secured}/v1/engines", data={"name": "x", "url": attacker_url, "models": MODEL},
                        headers=bearer(SECRET))

    assert (as_text.status_code, as_form.status_code) == (415, 415)
    assert as_text.json()["error"]["code"] == "unsupported_media_type"


def test_a_live_engines_url_cannot_be_taken(http, start_gateway, serve):
    from tests.support import fake_upstream

    gateway = start_gateway([], engines=EnginesConfig(registration_secret=SECRET, heartbeat_timeout_s=60.0))
    engine_url = serve(fake_upstream.app)
    first = register(http, gateway, engine_url)
    assert first.status_code == 201, first.text

    # The same address spelled otherwise, with other models: each refused.
    spellings = [engine_url, f"{engine_url}/", f"{engine_url.upper().replace('HTTP', 'http')}/v1",
                 engine_url.replace("http://", "HTTP://")]
    retries = [register(http, gateway, url, models=[MODEL, "other"]) for url in spellings]

    assert [r.status_code for r in retries] == [409] * len(spellings)
    assert retries[0].json()["error"]["code"] == "engine_url_taken"
    assert [e["id"] for e in http.get(f"{gateway}/v1/engines").json()] == [first.json()["id"]]
    assert chat_answers(http, gateway, {}, times=2) == ["echo: hello"] * 2
    heartbeat = http.post(f"{gateway}/v1/engines/{first.json()['id']}/heartbeat", json={},
                          headers=bearer(first.json()["token"]))
    assert heartbeat.status_code == 200


def test_an_engine_heartbeats_only_for_itself(http, start_gateway, serve, attacker):
    from tests.support import fake_upstream

    gateway = start_gateway([], engines=EnginesConfig(registration_secret=SECRET, heartbeat_timeout_s=60.0))
    victim = register(http, gateway, serve(fake_upstream.app)).json()
    other = register(http, gateway, attacker[0], models=["other-model"]).json()
    beat = f"{gateway}/v1/engines/{victim['id']}/heartbeat"

    forged = [http.post(beat, json={"waiting": 1000}, headers=headers)
              for headers in (bearer(other["token"]), bearer(SECRET), bearer(CLIENT_KEY), {})]
    with_text = http.post(beat, content=b'{"waiting": 0}',
                          headers={**bearer(victim["token"]), "content-type": "text/plain"})
    negative = http.post(beat, json={"waiting": -1000000}, headers=bearer(victim["token"]))
    own = http.post(beat, json={"running": 3}, headers=bearer(victim["token"]))

    assert [r.status_code for r in forged] == [401, 401, 401, 401]
    assert forged[0].json()["error"]["code"] == "invalid_engine_token"
    assert with_text.status_code == 415
    assert negative.status_code == 400 and negative.json()["error"]["param"] == "waiting"
    assert own.status_code == 200
    stats = {e["id"]: e["stats"] for e in http.get(f"{gateway}/v1/engines").json()}[victim["id"]]
    assert (stats["running"], stats["waiting"]) == (3, 0)
    refused = http.delete(f"{gateway}/v1/engines/{victim['id']}", headers=bearer(other["token"]))
    assert refused.status_code == 401
    assert victim["id"] in {e["id"] for e in http.get(f"{gateway}/v1/engines").json()}


def test_engine_listing_shows_no_credentials(http, secured, serve):
    from tests.support import fake_upstream

    registered = register(http, secured, serve(fake_upstream.app), models=["remote"]).json()

    listing = http.get(f"{secured}/v1/engines", headers=bearer(CLIENT_KEY))

    assert listing.status_code == 200 and len(listing.json()) == 2
    assert SECRET not in listing.text and registered["token"] not in listing.text
    assert http.get(f"{secured}/v1/engines").status_code == 401  # still a client route


# ---------------------------------------------------------------- the builtin engine's own port


@pytest.fixture(scope="module")
def tiny_config(tiny_model_dir) -> EngineConfig:
    return EngineConfig(model=str(tiny_model_dir), num_blocks=64, max_model_len=256)


@pytest.mark.timeout(120)
def test_the_engine_port_requires_the_secret_and_the_gateway_presents_it(http, start_gateway, serve, tiny_config,
                                                                         wait_until):
    gateway = start_gateway([], engines=EnginesConfig(registration_secret=SECRET, heartbeat_timeout_s=60.0))
    # The engine's URL is known once it serves: until then it announces an empty one, which is refused.
    registration = GatewayRegistration(gateway, "", "tiny", heartbeat_interval_s=0.2)
    engine = serve(create_engine_app(tiny_config, model_name="tiny", registration=registration, secret=SECRET))
    registration.advertise_url = engine

    completion = {"model": "tiny", "prompt": "Hello", "max_tokens": 2}
    refused = [http.post(f"{engine}/v1/completions", json=completion, headers=headers)
               for headers in ({}, bearer("wrong"), bearer(CLIENT_KEY))]
    assert [r.status_code for r in refused] == [401, 401, 401]
    assert refused[0].json()["error"]["code"] == "invalid_engine_secret"
    assert http.get(f"{engine}/v1/stats").status_code == 401
    assert http.get(f"{engine}/health").status_code == 200
    assert http.post(f"{engine}/v1/completions", json=completion, headers=bearer(SECRET)).status_code == 200

    wait_until(lambda: http.get(f"{gateway}/health/ready").status_code == 200, timeout_s=30)
    # Through the gateway: the proxied path, and the semantic one (render + context primitives).
    plain = http.post(f"{gateway}/v1/completions", json=completion)
    prefix = "You are a helpful assistant who answers in one short sentence, always politely. " * 2
    semantic = http.post(f"{gateway}/v1/chat/completions", json={
        "model": "tiny", "max_tokens": 2, "messages": [{"role": "system", "content": prefix},
                                                       {"role": "user", "content": "Say {{word}}."}],
        "parrot": {"vars": {"word": {"value": "hi"}}}}, timeout=60)
    assert plain.status_code == 200, plain.text
    assert semantic.status_code == 200, semantic.text


def test_health_routes_need_no_key(http, secured):
    for path in ("/health", "/health/ready", "/health/live"):
        assert http.get(f"{secured}{path}").status_code == 200, path
