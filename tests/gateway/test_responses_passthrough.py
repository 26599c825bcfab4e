"""POST /v1/responses passed through to an upstream that speaks the Responses API itself (``[[upstreams]]
responses = true``, the seam's ResponsesEngine). The upstream is real: a second Parrot gateway as its own process
(which serves /v1/responses over the fake upstream), behind the gateway under test, with its access log saying which
API it was asked. The gateway under test keeps the conversation and the store; the upstream is sent each turn whole."""

from __future__ import annotations

import json

import openai
import pytest

from gateway.config import UpstreamConfig
from tests.support.fake_upstream import MODEL
from tests.support.gateway_process import GatewayProcess
from tests.support import plain_http

pytestmark = pytest.mark.subprocess
INNER_KEY = "sk-inner"
WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}


@pytest.fixture(scope="module")
def inner(fake_url, tmp_path_factory):
    """The upstream: a Parrot gateway process (its own key, its access log in a file)."""
    log = tmp_path_factory.mktemp("inner") / "access.log"
    process = GatewayProcess(fake_url, "memory://", args=("--api-key", INNER_KEY, "--access-log", "--log-level", "info"),
                             log=log).start()
    try:
        yield process, log
    finally:
        process.stop()


@pytest.fixture(scope="module")
def outer(inner, serve_module, monkeypatch_module) -> str:
    from gateway.server.app import create_app
    from tests.support.gateways import gateway_config

    monkeypatch_module.setenv("PARROT_TEST_INNER_KEY", INNER_KEY)  # the upstream's key, replacing the client's
    upstream = UpstreamConfig(model=MODEL, base_url=f"{inner[0].url}/v1", api_key_env="PARROT_TEST_INNER_KEY",
                              responses=True)
    return serve_module(create_app(gateway_config([upstream])))


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as patch:
        yield patch


@pytest.fixture(scope="module")
def client(outer) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{outer}/v1", api_key="sk-a", max_retries=0, timeout=30) as client:
        yield client


def asked(log) -> list[str]:
    """The API paths the upstream was POSTed, in order."""
    return [line.split("POST ", 1)[1].split()[0] for line in log.read_text().splitlines() if "POST /v1/" in line]


def test_a_response_is_passed_through_and_stored_by_the_gateway(client, inner, fake_stats):
    before = len(asked(inner[1]))
    first = client.responses.create(model=MODEL, input="hello there", instructions="Be brief.", metadata={"k": "v"})

    assert asked(inner[1])[before:] == ["/v1/responses"]  # not /v1/chat/completions: the upstream's own API
    assert first.status == "completed" and first.output_text == "echo: hello there"
    assert first.model == MODEL and first.metadata == {"k": "v"} and first.store is True
    assert first.usage.input_tokens > 0 and first.usage.output_tokens == 3
    assert client.responses.retrieve(first.id).output_text == "echo: hello there"  # the gateway's store

    second = client.responses.create(model=MODEL, input="and more", previous_response_id=first.id)
    third = client.responses.create(model=MODEL, input="last", previous_response_id=second.id)
    assert third.output_text == "echo: last" and third.previous_response_id == second.id
    # The upstream got each turn whole (it stores nothing: store false), the earlier turns from the gateway's store.
    assert [m["content"] for m in fake_stats()["last_body"]["messages"]] == [
        "hello there", "echo: hello there", "and more", "echo: and more", "last"]
    assert asked(inner[1])[before:] == ["/v1/responses"] * 3
    assert [i.content for i in client.responses.input_items.list(third.id, order="asc").data] == ["last"]


def test_a_stream_is_passed_through_and_stored_before_it_ends(client, inner):
    before = len(asked(inner[1]))
    with client.responses.stream(model=MODEL, input="What is the weather?", tools=[WEATHER],
                                 tool_choice="required") as stream:
        events = list(stream)
        final = stream.get_final_response()

    assert asked(inner[1])[before:] == ["/v1/responses"]
    kinds = [e.type for e in events]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    assert "response.function_call_arguments.delta" in kinds
    numbers = [e.sequence_number for e in events]
    assert numbers == sorted(numbers) and len(set(numbers)) == len(numbers)
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments)
    assert events[0].response.id == final.id and final.model == MODEL
    assert client.responses.retrieve(final.id).output[0].call_id == call.call_id  # stored before the last event

    answer = client.responses.create(model=MODEL, previous_response_id=final.id, input=[
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}])
    assert answer.output_text == "echo: sunny"


def test_another_keys_response_is_404_and_bad_input_a_400_naming_it(client, outer):
    mine = client.responses.create(model=MODEL, input="mine")
    with openai.OpenAI(base_url=f"{outer}/v1", api_key="sk-b", max_retries=0, timeout=30) as other:
        for use in (other.responses.retrieve, other.responses.input_items.list, other.responses.delete,
                    lambda theirs: other.responses.create(model=MODEL, input="x", previous_response_id=theirs)):
            with pytest.raises(openai.NotFoundError):
                use(mine.id)
    assert client.responses.retrieve(mine.id).output_text == "echo: mine"  # still there for its own key

    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[{"type": "function_call_output", "output": "x"}])
    assert caught.value.body["param"] == "input[0].call_id"


def test_the_upstreams_errors_come_back_translated(client):
    with pytest.raises(openai.BadRequestError) as caught:  # the fake upstream, behind the inner gateway, refuses it
        client.responses.create(model=MODEL, input="x", extra_body={"fake": {"status": 400}})
    assert caught.value.status_code == 400 and caught.value.body["message"]

    with pytest.raises(openai.BadRequestError):  # and before a stream's first event: the request's status
        with client.responses.stream(model=MODEL, input="x", extra_body={"fake": {"status": 400}}) as stream:
            list(stream)


def test_a_semantic_request_runs_over_the_chat_path_of_the_same_upstream(client, inner):
    before = len(asked(inner[1]))
    response = client.responses.create(model=MODEL, input="Say {{w}}",
                                       extra_body={"parrot": {"vars": {"w": {"value": "yes"}}}})

    assert response.output_text == "echo: Say yes" and "parrot" in response.model_extra
    assert asked(inner[1])[before:] == ["/v1/chat/completions"]


def test_a_gateway_with_a_plain_upstream_still_runs_responses_over_chat(start_gateway, fake_stats):
    url = start_gateway()  # the fake upstream, not marked as speaking Responses (it does not)
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-a", max_retries=0, timeout=30) as client:
        assert client.responses.create(model=MODEL, input="plain").output_text == "echo: plain"
    assert fake_stats()["last_body"]["messages"] == [{"role": "user", "content": "plain"}]


def test_metrics_count_the_passed_through_tokens(client, outer):
    client.responses.create(model=MODEL, input="count these words")
    metrics = plain_http.get(f"{outer}/metrics").text
    generated = [line for line in metrics.splitlines() if line.startswith("parrot:generation_tokens_total{")]
    assert generated and float(generated[0].rsplit(" ", 1)[1]) > 0


def test_a_background_response_runs_in_the_gateway_and_an_upstream_failing_mid_stream_fails_it(client, outer,
                                                                                               wait_until):
    queued = client.responses.create(model=MODEL, input="later", background=True)
    assert queued.status == "queued"
    wait_until(lambda: client.responses.retrieve(queued.id).status == "completed")
    assert client.responses.retrieve(queued.id).output_text == "echo: later"

    body = {"model": MODEL, "input": "one two three four", "stream": True, "fake": {"die_after": 2}}
    with plain_http.stream("POST", f"{outer}/v1/responses", json=body, headers={"authorization": "Bearer sk-a"},
                      timeout=30) as answer:
        events = [json.loads(line[6:]) for line in answer.iter_lines() if line.startswith("data: ")]
    assert events[-1]["type"] == "response.failed" and events[-1]["response"]["status"] == "failed"
    assert client.responses.retrieve(events[0]["response"]["id"]).status == "failed"
