"""Every failure answers with an OpenAI error object and the status OpenAI clients expect."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from gateway.config import AuthConfig, LimitsConfig, RoutingConfig, UpstreamConfig
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve

MESSAGES = [{"role": "user", "content": "hello"}]
CHAT = {"model": MODEL, "messages": MESSAGES}


def assert_openai_error(response: httpx.Response, status: int, *, param: str | None = None,
                        code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    assert response.headers["content-type"].startswith("application/json")
    assert response.headers["x-request-id"]  # errors can be traced like successes
    body = response.json()
    assert set(body) == {"error"}
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if param is not None:
        assert error["param"] == param
    if code is not None:
        assert error["code"] == code
    return error


@pytest.fixture(scope="module")
def api(gateway_url) -> httpx.Client:
    with httpx.Client(base_url=gateway_url, timeout=10) as client:
        yield client


# ---------------------------------------------------------------- request validation


@pytest.mark.parametrize("body", [b'{"model": "fake-model", "messages": [', b"{'model': 1}", b"", b"[]", b'"hi"'])
def test_invalid_json_or_not_an_object(api, body):
    response = api.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})

    error = assert_openai_error(response, 400)
    assert error["param"] is None  # the body as a whole is wrong, not one field
    assert "'data'" not in error["message"]  # no framework internals


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/vars", "/v1/semantic_calls"])
def test_json_nested_too_deeply(api, path):
    deep = "[" * 5000 + "]" * 5000
    body = '{"model": "fake-model", "messages": [], "prompt": "hi", "extra": %s}' % deep

    assert_openai_error(api.post(path, content=body, headers={"content-type": "application/json"}), 400)


@pytest.mark.parametrize("messages, param", [
    ([{"role": "user"}], "messages[0].content"),
    ([{"role": "user", "content": None}], "messages[0].content"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}], "messages[1].content"),
    ([{"role": "tool", "content": "sunny"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": [{"type": "foo", "text": "hi"}]}], "messages[0].content[0].type"),
    ([{"role": "user", "content": [{"type": "text"}]}], "messages[0].content[0].text"),
])
def test_malformed_messages(api, messages, param):
    assert_openai_error(api.post("/v1/chat/completions", json={"model": MODEL, "messages": messages}), 400, param=param)


@pytest.mark.parametrize("names, param", [(["bad name!"], "tools[0].function.name"),
                                          (["f", "f"], "tools[1].function.name")])
def test_malformed_tool_names(api, names, param):
    tools = [{"type": "function", "function": {"name": name}} for name in names]
    assert_openai_error(api.post("/v1/chat/completions", json={**CHAT, "tools": tools}), 400, param=param)


def test_body_that_is_not_utf8(api):
    response = api.post("/v1/completions", content=b'{"model": "fake-model", "prompt": "\xff"}')

    assert_openai_error(response, 400)


@pytest.mark.parametrize("escape", [rb"\ud800", rb"\udc00", rb"x\ud83dy"])
def test_a_lone_surrogate_is_named_as_such(api, escape):
    """msgspec says "Input data was truncated" of a whole body holding one."""
    body = b'{"model": "fake-model", "messages": [{"role": "user", "content": "' + escape + b'"}]}'
    error = assert_openai_error(api.post("/v1/chat/completions", content=body,
                                         headers={"content-type": "application/json"}), 400)
    assert "surrogate" in error["message"] and "truncated" not in error["message"]
    paired = b'{"model": "fake-model", "messages": [{"role": "user", "content": "\\ud83d\\ude00"}]}'
    assert api.post("/v1/chat/completions", content=paired, headers={"content-type": "application/json"}).status_code == 200


def test_other_methods_on_the_openai_endpoints(api):
    get = api.get("/v1/chat/completions")
    options = api.options("/v1/completions")

    assert_openai_error(get, 405)
    assert get.headers["allow"] == options.headers["allow"] == "OPTIONS, POST"
    assert options.status_code == 204


@pytest.mark.parametrize("body, param", [
    ({**CHAT, "max_tokens": "many"}, "max_tokens"),
    ({**CHAT, "temperature": "hot"}, "temperature"),
    ({**CHAT, "messages": "hello"}, "messages"),
    ({**CHAT, "stream": "yes please"}, "stream"),
    ({"messages": MESSAGES}, "model"),
])
def test_wrong_field_types(api, body, param):
    error = assert_openai_error(api.post("/v1/chat/completions", json=body), 400)

    assert error["type"] == "invalid_request_error"
    assert param in (error["param"] or "") + error["message"]


@pytest.mark.parametrize("field, value", [("max_tokens", -1), ("max_tokens", 0), ("temperature", 3), ("n", 0), ("top_p", 1.5),
                                          ("presence_penalty", -2.5), ("seed", 2**64), ("seed", -(2**63) - 1)])
@pytest.mark.parametrize("stream", [False, True])
def test_out_of_range_values(api, field, value, stream):
    body = {**CHAT, field: value, **({"stream": True} if stream else {})}
    error = assert_openai_error(api.post("/v1/chat/completions", json=body), 400)

    assert field in (error["param"] or "") + error["message"]


def test_out_of_range_on_completions_too(api):
    assert_openai_error(api.post("/v1/completions", json={"model": MODEL, "prompt": "x", "max_tokens": 0}), 400)


def test_top_logprobs_without_logprobs(api):
    response = api.post("/v1/chat/completions", json={**CHAT, "top_logprobs": 3})

    assert_openai_error(response, 400, param="top_logprobs")


def test_stream_options_without_stream(api):
    response = api.post("/v1/chat/completions", json={**CHAT, "stream_options": {"include_usage": True}})

    assert_openai_error(response, 400, param="stream_options")


def test_empty_messages(api):
    error = assert_openai_error(api.post("/v1/chat/completions", json={**CHAT, "messages": []}), 400)

    assert "messages" in (error["param"] or "") + error["message"]


def test_unknown_model(api):
    response = api.post("/v1/chat/completions", json={**CHAT, "model": "gpt-nonexistent"})

    error = assert_openai_error(response, 404, param="model", code="model_not_found")
    assert "gpt-nonexistent" in error["message"]


def test_unknown_model_through_the_sdk(gateway_url):
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)

    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-nonexistent", messages=MESSAGES)

    assert caught.value.code == "model_not_found"


# ---------------------------------------------------------------- configured limits and auth


def test_max_tokens_above_configured_limit(http, start_gateway):
    url = start_gateway(limits=LimitsConfig(max_tokens=64))

    too_many = http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 65})
    too_many_new_name = http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_completion_tokens": 65})
    at_limit = http.post(f"{url}/v1/chat/completions", json={**CHAT, "max_tokens": 64})

    error = assert_openai_error(too_many, 400, param="max_tokens")
    assert "64" in error["message"]
    assert_openai_error(too_many_new_name, 400)
    assert at_limit.status_code == 200


def test_body_larger_than_limit(http, start_gateway):
    url = start_gateway(limits=LimitsConfig(max_body_bytes=2_000))
    big = {**CHAT, "messages": [{"role": "user", "content": "x" * 5_000}]}

    response = http.post(f"{url}/v1/chat/completions", json=big)
    small = http.post(f"{url}/v1/chat/completions", json=CHAT)

    assert_openai_error(response, 413)
    assert small.status_code == 200


@pytest.fixture
def authed_url(start_gateway) -> str:
    return start_gateway(auth=AuthConfig(api_keys=["key-one", "key-two"]))


@pytest.mark.parametrize("headers", [{}, {"authorization": "Bearer wrong-key"}, {"authorization": "key-one"},
                                     {"authorization": "Bearer"}])
def test_missing_or_wrong_api_key(http, authed_url, headers):
    response = http.post(f"{authed_url}/v1/chat/completions", json=CHAT, headers=headers)

    error = assert_openai_error(response, 401, code="invalid_api_key")
    assert error["type"] == "authentication_error"
    assert "key-one" not in response.text


def test_auth_comes_before_validation_and_model_lookup(http, authed_url):
    response = http.post(f"{authed_url}/v1/chat/completions", json={"model": "nope", "messages": []})

    assert_openai_error(response, 401)


def test_every_configured_key_is_accepted(authed_url):
    for key in ("key-one", "key-two"):
        client = openai.OpenAI(base_url=f"{authed_url}/v1", api_key=key, max_retries=0)
        assert client.chat.completions.create(model=MODEL, messages=MESSAGES).choices[0].message.content

    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=f"{authed_url}/v1", api_key="key-three", max_retries=0).models.list()


def test_health_and_metrics_stay_open_with_auth(http, authed_url):
    assert http.get(f"{authed_url}/health").status_code == 200
    assert http.get(f"{authed_url}/metrics").status_code == 200
    assert http.get(f"{authed_url}/v1/models").status_code == 401


# ---------------------------------------------------------------- engine failures


def test_upstream_down(http, start_gateway, unused_tcp_port):
    url = start_gateway([UpstreamConfig(model=MODEL, base_url=f"http://127.0.0.1:{unused_tcp_port}/v1")],
                        routing=RoutingConfig(breaker_failures=1, retry_backoff_s=0.01))

    response = http.post(f"{url}/v1/chat/completions", json=CHAT)
    streamed = http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True})

    assert_openai_error(response, 502, code="upstream_unavailable")
    # Its circuit is open, but a sole engine is still tried rather than the request refused unseen.
    assert_openai_error(streamed, 502, code="upstream_unavailable")
    assert http.get(f"{url}/health").status_code == 503


@pytest.mark.parametrize("stream", [False, True])
def test_upstream_down_is_retried_on_a_healthy_one(http, start_gateway, fake_url, unused_tcp_port, stream):
    url = start_gateway([UpstreamConfig(model=MODEL, base_url=f"http://127.0.0.1:{unused_tcp_port}/v1",
                                        name="dead"),
                         UpstreamConfig(model=MODEL, base_url=f"{fake_url}/v1", name="alive")],
                        routing=RoutingConfig(breaker_failures=1, health_check_interval_s=0))

    # Round-robin starts each request at the next engine, so one of two requests tries the dead one first.
    for _ in range(2):
        response = http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": stream})
        assert response.status_code == 200
        if stream:
            assert '"content":" hello"' in response.text and response.text.endswith("data: [DONE]\n\n")
        else:
            assert response.json()["choices"][0]["message"]["content"] == "echo: hello"

    engines = {e["name"]: e for e in http.get(f"{url}/v1/engines").json()}
    assert engines["dead"]["healthy"] is False  # it was tried, failed, and its circuit is open
    assert engines["alive"]["healthy"] is True


def test_upstream_slower_than_timeout(http, start_gateway):
    # Not retried here: that a timeout is retried is tests/gateway/test_resilience.py's.
    url = start_gateway(limits=LimitsConfig(request_timeout_s=0.3), routing=RoutingConfig(num_retries=0))

    response = http.post(f"{url}/v1/chat/completions", json={**CHAT, "fake": {"delay_s": 1.5}})
    streamed = http.post(f"{url}/v1/chat/completions", json={**CHAT, "stream": True, "fake": {"delay_s": 1.5}})

    assert_openai_error(response, 504, code="upstream_timeout")
    assert_openai_error(streamed, 504, code="upstream_timeout")


def test_upstream_stalling_mid_stream_ends_with_a_timeout_event(http, start_gateway):
    url = start_gateway(limits=LimitsConfig(request_timeout_s=0.3))

    stalled = http.post(f"{url}/v1/chat/completions",
                        json={**CHAT, "stream": True, "fake": {"words": 3, "chunk_delay_s": 1.0}})

    assert stalled.status_code == 200  # the first chunk came in time
    events = stalled.text.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    assert json.loads(events[-3].removeprefix("data: "))["error"]["code"] == "upstream_timeout"


@pytest.mark.parametrize("status", [400, 404, 422, 429])
@pytest.mark.parametrize("stream", [False, True])
def test_upstream_error_status_and_body_pass_through(api, status, stream):
    response = api.post("/v1/chat/completions", json={**CHAT, "stream": stream, "fake": {"status": status}})

    error = assert_openai_error(response, status, code="fake")
    assert error["message"] == "fake upstream error"


def test_upstream_failure_mid_stream_becomes_an_sse_error(api):
    with api.stream("POST", "/v1/chat/completions",
                     json={**CHAT, "stream": True, "fake": {"words": 10, "die_after": 3}}) as response:
        raw = response.read().decode()

    assert response.status_code == 200
    events = raw.split("\n\n")
    assert events[-2:] == ["data: [DONE]", ""]
    payloads = [json.loads(e.removeprefix("data: ")) for e in events[:-2]]
    assert [p["choices"][0]["delta"].get("content") for p in payloads[:3]] == ["", "w0", " w1"]
    assert set(payloads[-1]) == {"error"}
    assert set(payloads[-1]["error"]) == {"message", "type", "param", "code"}
    assert len(payloads) == 4


def test_upstream_failure_mid_stream_raises_in_the_sdk(gateway_url):
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL, messages=MESSAGES, stream=True,
                                            extra_body={"fake": {"words": 10, "die_after": 3}})

    with pytest.raises(openai.APIError):
        for _ in stream:
            pass
