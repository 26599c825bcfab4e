"""POST /v1/messages and /v1/messages/count_tokens through the official anthropic SDK, against a real gateway
on loopback in front of the fake upstream (which echoes the last message, or calls the first tool)."""

from __future__ import annotations

import pytest

from gateway.config import AuthConfig
from tests.support.fake_upstream import MODEL
from tests.support import plain_http

WEATHER = {"name": "get_weather", "description": "Weather for a city.",
           "input_schema": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}


@pytest.fixture(scope="module")
def client(gateway_url) -> anthropic.Anthropic:
    import anthropic  # here, not at the top: every xdist worker imports every collected module, anthropic in seconds

    with anthropic.Anthropic(base_url=gateway_url, api_key="sk-ant", max_retries=0, timeout=10) as client:
        yield client


def test_create(client, fake_stats):
    message = client.messages.create(model=MODEL, max_tokens=32, system="Be brief.",
                                     messages=[{"role": "user", "content": "hello there"}])

    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert [b.type for b in message.content] == ["text"] and message.content[0].text == "echo: hello there"
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    assert message.usage.output_tokens == 3 and message.usage.input_tokens > 0
    assert message.usage.cache_read_input_tokens == 0 and message.usage.service_tier == "standard"
    sent = fake_stats()["last_body"]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    assert sent["max_tokens"] == 32


def test_a_tool_round_trip_with_content_blocks(client, fake_stats):
    first = client.messages.create(model=MODEL, max_tokens=32, tools=[WEATHER],
                                   tool_choice={"type": "any"},
                                   messages=[{"role": "user", "content": [{"type": "text", "text": "weather?"}]}])

    assert first.stop_reason == "tool_use"
    use = first.content[0]
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"x": 1}
    assert fake_stats()["last_body"]["tool_choice"] == "required"
    second = client.messages.create(model=MODEL, max_tokens=32, tools=[WEATHER], tool_choice={"type": "none"},
                                    messages=[{"role": "user", "content": "weather?"},
                                              {"role": "assistant", "content": first.content},
                                              {"role": "user", "content": [
                                                  {"type": "tool_result", "tool_use_id": use.id, "content": "sunny"}]}])

    assert second.content[0].text == "echo: sunny"
    messages = fake_stats()["last_body"]["messages"]
    assert messages[-2]["tool_calls"][0] == {"id": use.id, "type": "function",
                                             "function": {"name": "get_weather", "arguments": '{"x": 1}'}}
    assert messages[-1] == {"role": "tool", "tool_call_id": use.id, "content": "sunny"}


def test_stop_sequences_sampling_and_output_format_reach_the_engine(client, fake_stats):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    client.messages.create(model=MODEL, max_tokens=8, stop_sequences=["END"], messages=[{"role": "user", "content": "hi"}],
                           output_config={"format": {"type": "json_schema", "schema": schema}},
                           extra_body={"temperature": 0.5, "top_k": 5})
    sent = fake_stats()["last_body"]
    assert sent["stop"] == ["END"] and sent["temperature"] == 0.5 and sent["top_k"] == 5
    assert sent["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "output", "schema": schema, "strict": True}}


def test_stream_text(client):
    with client.messages.stream(model=MODEL, max_tokens=32, messages=[{"role": "user", "content": "one two"}]) as s:
        events = list(s)
        final = s.get_final_message()

    kinds = [e.type for e in events]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert "content_block_start" in kinds and "content_block_stop" in kinds and "message_delta" in kinds
    assert final.content[0].text == "echo: one two"
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == 3 and final.usage.input_tokens > 0


def test_stream_a_tool_whose_arguments_stream(client):
    with client.messages.stream(model=MODEL, max_tokens=32, tools=[WEATHER],
                                messages=[{"role": "user", "content": "weather?"}]) as stream:
        events = list(stream)
        final = stream.get_final_message()

    deltas = [e.delta.partial_json for e in events if e.type == "content_block_delta"
              and e.delta.type == "input_json_delta"]
    assert "".join(deltas) == '{"x": 1}'
    assert final.content[0].type == "tool_use" and final.content[0].input == {"x": 1}
    assert final.stop_reason == "tool_use"


def test_the_raw_stream_names_each_event(gateway_url):
    with plain_http.stream("POST", f"{gateway_url}/v1/messages", headers={"anthropic-version": "2023-06-01"},
                      json={"model": MODEL, "max_tokens": 8, "stream": True,
                            "messages": [{"role": "user", "content": "hi"}]}) as answer:
        lines = [line for line in answer.iter_lines() if line]
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names == ["message_start", "content_block_start", "content_block_delta", "content_block_delta",
                     "content_block_stop", "message_delta", "message_stop"]


def test_count_tokens(client, fake_stats):
    count = client.messages.count_tokens(model=MODEL, system="Be brief.", tools=[WEATHER],
                                         messages=[{"role": "user", "content": "hello there"}])

    assert count.input_tokens > 0
    assert fake_stats()["last_body"]["max_tokens"] == 1


def test_errors_are_anthropic_shaped(client):
    import anthropic

    with pytest.raises(anthropic.NotFoundError) as caught:
        client.messages.create(model="no-such-model", max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["type"] == "error" and caught.value.body["error"]["type"] == "not_found_error"
    with pytest.raises(anthropic.BadRequestError) as caught:
        client.messages.create(model=MODEL, max_tokens=8, messages=[
            {"role": "user", "content": [{"type": "tool_result", "content": "x"}]}])
    assert caught.value.body["error"]["type"] == "invalid_request_error"
    assert "messages[0].content[0]" in caught.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError):
        client.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}],
                               tools=[{"type": "web_search_20250305", "name": "web_search"}])


def test_x_api_key_authenticates(start_gateway):
    import anthropic

    url = start_gateway(auth=AuthConfig(api_keys=["sk-good"]))
    with anthropic.Anthropic(base_url=url, api_key="sk-good", max_retries=0, timeout=10) as good:
        assert good.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}]).content
    with anthropic.Anthropic(base_url=url, api_key="sk-bad", max_retries=0, timeout=10) as bad:
        with pytest.raises(anthropic.AuthenticationError) as caught:
            bad.messages.create(model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "x"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
