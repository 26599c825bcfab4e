"""The official openai SDK, sync and async, pointed at the gateway in front of the fake upstream."""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather for a city.",
        "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]},
    },
}


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=10) as client:
        yield client


@pytest.fixture
async def async_client(gateway_url) -> openai.AsyncOpenAI:
    async with openai.AsyncOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0,
                                  timeout=10) as client:
        yield client


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_chat_completion(client):
    reply = client.chat.completions.create(model=MODEL, messages=user("hello there"))

    assert reply.object == "chat.completion"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == "echo: hello there"
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens == 3


async def test_async_chat_completions_run_concurrently_and_stay_apart(async_client):
    texts = [f"request number {i}" for i in range(6)]

    replies = await asyncio.gather(*(async_client.chat.completions.create(model=MODEL, messages=user(t))
                                     for t in texts))

    assert [r.choices[0].message.content for r in replies] == [f"echo: {t}" for t in texts]


def test_stream_with_usage(client):
    stream = client.chat.completions.create(model=MODEL, messages=user("one two three"), stream=True,
                                            stream_options={"include_usage": True})
    chunks = list(stream)

    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == "echo: one two three"
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == []
    assert usage_chunk.usage.completion_tokens == 4
    assert all(c.usage is None for c in chunks[:-1])


async def test_async_stream(async_client):
    stream = await async_client.chat.completions.create(model=MODEL, messages=user("async words"), stream=True)

    text = "".join([c.choices[0].delta.content or "" async for c in stream])

    assert text == "echo: async words"


async def test_concurrent_streams_do_not_mix(async_client):
    async def one(i: int) -> str:
        stream = await async_client.chat.completions.create(model=MODEL, messages=user(f"stream {i} says hi"),
                                                            stream=True, extra_body={"fake": {"chunk_delay_s": 0.01}})
        return "".join([c.choices[0].delta.content or "" async for c in stream])

    texts = await asyncio.gather(*(one(i) for i in range(16)))

    assert texts == [f"echo: stream {i} says hi" for i in range(16)]


def test_n_choices(client):
    reply = client.chat.completions.create(model=MODEL, messages=user("twice"), n=2)

    assert [c.index for c in reply.choices] == [0, 1]
    assert {c.message.content for c in reply.choices} == {"echo: twice"}
    assert reply.usage.completion_tokens == 2 * 2


def test_n_choices_streamed(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("twice"), n=2, stream=True))

    texts = {0: "", 1: ""}
    for chunk in chunks:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
    assert texts == {0: "echo: twice", 1: "echo: twice"}


@pytest.mark.parametrize("tool_choice", ["auto", {"type": "function", "function": {"name": "get_weather"}}])
def test_tool_calls_pass_through(client, fake_stats, tool_choice):
    reply = client.chat.completions.create(model=MODEL, messages=user("weather?"), tools=[WEATHER_TOOL],
                                           tool_choice=tool_choice)

    (call,) = reply.choices[0].message.tool_calls
    assert (call.id, call.type, call.function.name) == ("call_0", "function", "get_weather")
    assert json.loads(call.function.arguments) == {"x": 1}
    assert reply.choices[0].finish_reason == "tool_calls"
    sent = fake_stats()["last_body"]
    assert sent["tools"] == [WEATHER_TOOL] and sent["tool_choice"] == tool_choice


def test_tool_calls_streamed(client):
    chunks = list(client.chat.completions.create(model=MODEL, messages=user("weather?"), tools=[WEATHER_TOOL],
                                                 tool_choice="required", stream=True))

    deltas = [tc for c in chunks if c.choices for tc in c.choices[0].delta.tool_calls or []]
    assert [d.function.name for d in deltas if d.function and d.function.name] == ["get_weather"]
    assert json.loads("".join(d.function.arguments or "" for d in deltas)) == {"x": 1}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_max_completion_tokens_is_forwarded(client, fake_stats):
    client.chat.completions.create(model=MODEL, messages=user("short"), max_completion_tokens=5)

    sent = fake_stats()["last_body"]
    assert sent["max_completion_tokens"] == 5
    assert "max_tokens" not in sent


def test_completion_with_list_prompt(client, fake_stats):
    reply = client.completions.create(model=MODEL, prompt=["first prompt", "second prompt"], max_tokens=4)

    assert reply.object == "text_completion"
    assert len(reply.choices) == 2
    assert reply.choices[0].text == "echo: first prompt"
    assert fake_stats()["last_body"]["prompt"] == ["first prompt", "second prompt"]


def test_models_list_and_retrieve(client):
    assert [m.id for m in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")


def test_extra_body_is_forwarded_except_parrot(client, fake_stats):
    extra = {"top_k": 5, "my_vendor_knob": {"nested": [1, "two", None]}, "parrot": {"criteria": "latency"}}

    reply = client.chat.completions.create(model=MODEL, messages=user("extras"), extra_body=extra)

    assert reply.choices[0].message.content == "echo: extras"
    sent = fake_stats()["last_body"]
    assert sent["top_k"] == 5
    assert sent["my_vendor_knob"] == {"nested": [1, "two", None]}
    assert "parrot" not in sent
