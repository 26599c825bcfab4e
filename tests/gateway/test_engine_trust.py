"""Engine trust: only holders of the engine secret register engines, each engine speaks only for
itself, and no one takes another engine's place. The "attacker" is a real server on loopback that
would answer chat requests if the gateway ever routed one to it."""

from __future__ import annotations

import json

import httpx
import pytest

from engines.builtin.config import EngineConfig
from engines.builtin.server.app import GatewayRegistration, create_app as create_engine_app
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


def test_a_gateway_whose_only_engines_are_its_own_answers_registration_403(http, serve, fake_url, attacker):
    """`parrot serve` with no [engines] registration_secret: its builtin engine registers with a secret of its
    own, and anyone else is told registration is disabled (403, as the README says), not 401."""
    from gateway.server.app import create_app
    from gateway.config import UpstreamConfig
    from tests.gateway.conftest import gateway_config

    app = create_app(gateway_config([UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1")]))
    gateway = serve(app)
    app.state.gateway.registry.allow_secret("own-engine-secret")  # as the supervisor does for its engine
    attacker_url, _ = attacker

    guessed = register(http, gateway, attacker_url, "a-guess")
    own = register(http, gateway, attacker_url, "own-engine-secret")

    assert guessed.status_code == 403 and guessed.json()["error"]["code"] == "engine_registration_disabled"
    assert own.status_code == 201, own.text


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
    port = engine_url.rsplit(":", 1)[1]
    spellings = [engine_url, f"{engine_url}/", f"{engine_url.upper().replace('HTTP', 'http')}/v1",
                 engine_url.replace("http://", "HTTP://"),
                 # Host aliases of the same listener: once each registered beside it (with the secret).
                 f"http://localhost:{port}", f"http://127.1:{port}", f"http://[::1]:{port}", f"http://0.0.0.0:{port}"]
    retries = [register(http, gateway, url, models=[MODEL, "other"]) for url in spellings]

    assert [r.status_code for r in retries] == [409] * len(spellings)
    assert retries[0].json()["error"]["code"] == "engine_url_taken"
    assert [e["id"] for e in http.get(f"{gateway}/v1/engines").json()] == [first.json()["id"]]
    assert chat_answers(http, gateway, {}, times=2) == ["echo: hello"] * 2
    heartbeat = http.post(f"{gateway}/v1/engines/{first.json()['id']}/heartbeat", json={},
                          headers=bearer(first.json()["token"]))
    assert heartbeat.status_code == 200


@pytest.fixture
def refusing_engine(serve) -> str:
    """An engine that refuses the gateway's credentials, as a builtin engine does a secret not its own."""

    async def handler(scope, receive, send):
        body = json.dumps({"error": {"message": "This engine takes requests from its gateway only",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "invalid_engine_secret"}}).encode()
        await send({"type": "http.response.start", "status": 401, "headers": [(b"content-type", b"application/json")]})
        await send({"type": "http.response.body", "body": body})

    return serve(asgi_app(handler))


def test_an_engine_refusing_the_gateway_is_an_engine_failure_not_the_clients(http, start_gateway, serve,
                                                                             refusing_engine):
    """Its 401 is retried on another engine and opens its circuit; a client never gets it as its own
    auth error (the openai SDK raised AuthenticationError with the user's valid key)."""
    from benchmarks import fake_upstream

    gateway = start_gateway([], auth=AuthConfig(api_keys=[CLIENT_KEY]),
                            engines=EnginesConfig(registration_secret=SECRET, heartbeat_timeout_s=60.0))
    refusing = register(http, gateway, refusing_engine, name="refusing").json()
    alone = http.post(f"{gateway}/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES},
                      headers=bearer(CLIENT_KEY))
    assert alone.status_code == 502, alone.text
    assert alone.json()["error"]["code"] == "upstream_auth_failed" and refusing_engine not in alone.text

    register(http, gateway, serve(fake_upstream.app), name="good")
    assert chat_answers(http, gateway, bearer(CLIENT_KEY), times=12) == ["echo: hello"] * 12
    listed = {e["id"]: e for e in http.get(f"{gateway}/v1/engines", headers=bearer(CLIENT_KEY)).json()}
    assert listed[refusing["id"]]["healthy"] is False  # its circuit opened


@pytest.mark.parametrize("stats, field", [
    ({"blocks_total": 728, "blocks_free": 7280}, "blocks_free"),  # once listed as kv_use -9.0
    ({"running": 10**40}, "running"),  # once echoed beyond int64
    ({"waiting": 2**63}, "waiting"),
    ({"num_preemptions": 1, "latency_preemptions": 2}, "latency_preemptions"),
])
def test_a_heartbeat_with_impossible_stats_is_refused(http, start_gateway, serve, stats, field):
    from benchmarks import fake_upstream

    gateway = start_gateway([], engines=EnginesConfig(registration_secret=SECRET, heartbeat_timeout_s=60.0))
    engine = register(http, gateway, serve(fake_upstream.app)).json()
    beat = f"{gateway}/v1/engines/{engine['id']}/heartbeat"

    refused = http.post(beat, json=stats, headers=bearer(engine["token"]))
    within = http.post(beat, json={"running": 2**63 - 1, "blocks_total": 728, "blocks_free": 728},
                       headers=bearer(engine["token"]))

    assert refused.status_code == 400 and field in refused.json()["error"]["message"], refused.text
    assert within.status_code == 200, within.text
    [listed] = http.get(f"{gateway}/v1/engines").json()
    assert listed["kv_use"] == 0.0 and listed["stats"]["running"] == 2**63 - 1


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
