"""The wire as curl sees it: raw httpx against the gateway, no SDK smoothing anything over."""

from __future__ import annotations

import gzip
import json
import re

import httpx
import pytest

from wire.sse import SSE_DONE
from gateway.config import UpstreamConfig
from tests.engines.seam.test_upstream_stream import FIRST, LAST, sse_app
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve

CHAT = {"model": MODEL, "messages": [{"role": "user", "content": "hi there"}]}


@pytest.fixture(scope="module")
def api(gateway_url) -> httpx.Client:
    with httpx.Client(base_url=gateway_url, timeout=10) as client:
        yield client


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/chat/completions", CHAT),
    ("POST", "/v1/chat/completions", {**CHAT, "stream": True}),
    ("POST", "/v1/chat/completions", {**CHAT, "n": 0}),
    ("POST", "/v1/completions", {"model": "nope", "prompt": "x"}),
    ("GET", "/v1/models", None),
    ("GET", "/health", None),
    ("GET", "/metrics", None),
    ("GET", "/no/such/route", None),
])
def test_every_response_has_a_request_id(api, method, path, body):
    response = api.request(method, path, json=body)

    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])
    assert response.headers.get_list("x-content-type-options") == ["nosniff"]  # JSON that echoes input is no page


@pytest.mark.parametrize("path", ["/v1/models", "/health", "/metrics", "/dashboard"])
def test_head_is_answered_as_get_without_a_body(api, path):
    """HEAD on a GET route was a 405."""
    got, head = api.get(path), api.head(path)

    assert head.status_code == got.status_code == 200
    assert head.content == b"" and head.headers["content-type"] == got.headers["content-type"]
    assert api.head("/v1/chat/completions").status_code == 405  # a POST-only route still is


def test_request_ids_differ_per_request(api):
    ids = {api.get("/v1/models").headers["x-request-id"] for _ in range(3)}

    assert len(ids) == 3


def test_an_empty_incoming_request_id_gets_one_made(api):
    response = api.get("/v1/models", headers={"x-request-id": ""})

    assert re.fullmatch(r"[0-9a-f]{32}", response.headers["x-request-id"])


@pytest.mark.parametrize("stream", [False, True])
def test_incoming_request_id_is_echoed(api, stream):
    response = api.post("/v1/chat/completions", json={**CHAT, "stream": stream},
                         headers={"x-request-id": "client-chosen-id-42"})

    assert response.status_code == 200
    assert response.headers["x-request-id"] == "client-chosen-id-42"


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "stream_options": {"include_usage": True}}),
    ("/v1/completions", {"model": MODEL, "prompt": "complete me"}),
])
def test_sse_framing_is_exactly_data_lines(api, path, body):
    with api.stream("POST", path, json={**body, "stream": True}) as response:
        raw = response.read().decode()

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("text/event-stream")
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]  # the stream ends with exactly "data: [DONE]\n\n"
    payloads = events[:-2]
    assert len(payloads) >= 3
    for event in payloads:
        assert event.startswith("data: {") and "\n" not in event and "\r" not in event
        json.loads(event.removeprefix("data: "))


def test_non_streaming_reply_is_json(api):
    response = api.post("/v1/chat/completions", json=CHAT)

    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/json")
    assert response.json()["choices"][0]["message"]["content"] == "echo: hi there"


def test_health_reports_engines(api):
    response = api.get("/health")

    assert response.status_code == 200
    assert response.json() == {"status": "ok", "engines": 1, "healthy_engines": 1, "models_without_engine": [],
                               "engine_restarts": 0, "state_store": "memory", "state_store_ok": True,
                               "state_store_ms": 0.0, "state_writes_pending": 0}
    assert api.get("/health/ready").json() == response.json()
    assert (api.get("/health/live").status_code, api.get("/health/live").json()) == (200, {"status": "ok"})


def test_model_names_with_slashes(http, start_gateway, fake_url, fake_stats):
    name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    url = start_gateway([UpstreamConfig(model=name, base_url=f"{fake_url}/v1", upstream_model="served-name")])

    card = http.get(f"{url}/v1/models/{name}")
    reply = http.post(f"{url}/v1/chat/completions", json={**CHAT, "model": name})

    assert card.status_code == 200 and card.json()["id"] == name
    assert http.get(f"{url}/v1/models/HuggingFaceTB/other").status_code == 404
    assert reply.status_code == 200
    assert fake_stats()["last_body"]["model"] == "served-name"  # rewritten on the way to the upstream


# ---------------------------------------------------------------- upstreams that frame SSE differently

QUIRKY_CHUNKS = [{"choices": [{"index": 0, "delta": {"content": word}, "finish_reason": None}]}
                 for word in ("one", " two", " three")]


def sse_body(separator: bytes, extras: bool) -> bytes:
    events = [b"data: " + json.dumps(c).encode() for c in QUIRKY_CHUNKS] + [b"data: [DONE]"]
    if extras:  # what real servers interleave: comments, keep-alives, event names and ids
        events = [b": keep-alive", *[b"event: chunk" + separator + b"id: 1" + separator + e for e in events]]
    return b"".join(e + separator * 2 for e in events)


def quirky_upstream(body: bytes, *, piece: int, gzipped: bool):
    """A raw ASGI upstream answering every POST with ``body`` as SSE, ``piece`` bytes per write."""

    async def app(scope, receive, send):
        if scope["type"] != "http":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        while (await receive()).get("more_body"):
            pass
        payload = gzip.compress(body) if gzipped else body
        headers = [(b"content-type", b"text/event-stream")] + ([(b"content-encoding", b"gzip")] if gzipped else [])
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        for start in range(0, len(payload), piece):
            await send({"type": "http.response.body", "body": payload[start:start + piece], "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


@pytest.mark.parametrize("separator, extras, piece, gzipped", [
    (b"\n", False, 1, False),
    (b"\r\n", False, 7, False),
    (b"\n", True, 5, False),
    (b"\r\n", True, 3, False),
    (b"\n", False, 10_000, True),
    (b"\n", True, 16, True),
], ids=["lf-bytewise", "crlf", "extras", "crlf-extras", "gzip", "gzip-extras-pieces"])
def test_upstream_sse_framing_variants(http, serve, start_gateway, separator, extras, piece, gzipped):
    upstream = serve(quirky_upstream(sse_body(separator, extras), piece=piece, gzipped=gzipped))
    url = start_gateway([UpstreamConfig(model=MODEL, base_url=f"{upstream}/v1")])

    raw = http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True}).text

    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert [json.loads(e.removeprefix("data: ")) for e in events[:-2]] == QUIRKY_CHUNKS


@pytest.mark.parametrize("done", [True, False])
def test_done_is_sent_exactly_once_whether_or_not_the_upstream_sends_it(http, start_gateway, serve, done):
    url = start_gateway([UpstreamConfig(model="m", base_url=f"{serve(sse_app(done=done))}/v1")])
    body = http.post(f"{url}/v1/chat/completions",
                     json={"model": "m", "stream": True, "messages": [{"role": "user", "content": "hi"}]}).content
    assert body == FIRST + LAST + SSE_DONE
