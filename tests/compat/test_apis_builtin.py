"""The Responses and Messages APIs through the openai and anthropic SDKs, on a real gateway in front of a real
builtin engine process on SmolLM2-135M: real tokens, grammars for structured output and tool calls, the engine's
prefix cache in the usage's cached tokens."""

from __future__ import annotations

import json

import anthropic
import openai
import pydantic
import pytest

from tests.support.models import SMOLLM
from tests.support import plain_http

# Every test here loads a model in an engine process (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.model, pytest.mark.subprocess]

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city.", "strict": True,
           "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
                          "additionalProperties": False}}


@pytest.fixture(scope="module")
def gateway_url(smollm_gateway) -> str:
    return smollm_gateway["gateway"]


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


class City(pydantic.BaseModel):
    city: str
    country: str


def test_responses_on_the_builtin_engine(client):
    first = client.responses.create(model=SMOLLM, input="What is the capital of France?", temperature=0,
                                    max_output_tokens=24, instructions="Answer in one short sentence.",
                                    service_tier="flex")
    assert "Paris" in first.output_text and first.usage.input_tokens > 0 and first.service_tier == "flex"

    second = client.responses.create(model=SMOLLM, input="And of Italy?", previous_response_id=first.id,
                                     temperature=0, max_output_tokens=24,
                                     instructions="Answer in one short sentence.")  # not carried over: sent again
    assert second.output_text.strip()
    # The conversation's first turn is in the engine's prefix cache (whole 16-token blocks): the usage says so.
    assert second.usage.input_tokens > first.usage.input_tokens
    assert second.usage.input_tokens_details.cached_tokens > 0

    parsed = client.responses.parse(model=SMOLLM, input="Name a city and its country.", text_format=City,
                                    temperature=0, max_output_tokens=48)
    assert isinstance(parsed.output_parsed, City)

    with client.responses.stream(model=SMOLLM, input="What is the weather in Paris?", tools=[WEATHER],
                                 tool_choice="required", temperature=0, max_output_tokens=48) as stream:
        events = list(stream)
        final = stream.get_final_response()
    call = final.output[0]
    assert call.type == "function_call" and call.name == "get_weather"
    assert set(json.loads(call.arguments)) == {"city"}
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == call.arguments


def test_messages_on_the_builtin_engine(gateway_url):
    with anthropic.Anthropic(base_url=gateway_url, api_key="unused", max_retries=0, timeout=120) as client:
        question = [{"role": "user", "content": "What is the capital of France?"}]
        message = client.messages.create(model=SMOLLM, max_tokens=24, messages=question,
                                         system="Answer in one short sentence.", extra_body={"temperature": 0})
        assert "Paris" in message.content[0].text
        count = client.messages.count_tokens(model=SMOLLM, messages=question, system="Answer in one short sentence.")
        assert count.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens

        words = message.content[0].text.split()
        stop = words[len(words) // 2]  # greedy: the same answer again stops there
        stopped = client.messages.create(model=SMOLLM, max_tokens=24, messages=question, stop_sequences=[stop],
                                         system="Answer in one short sentence.", extra_body={"temperature": 0})
        assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == stop

        tool = {"name": "get_weather", "description": WEATHER["description"], "input_schema": WEATHER["parameters"]}
        with client.messages.stream(model=SMOLLM, max_tokens=48, tools=[tool], tool_choice={"type": "any"},
                                    messages=[{"role": "user", "content": "What is the weather in Paris?"}]) as stream:
            events = list(stream)
            final = stream.get_final_message()
        use = final.content[-1]
        assert final.stop_reason == "tool_use" and use.type == "tool_use" and set(use.input) == {"city"}
        assert any(e.type == "content_block_delta" and e.delta.type == "input_json_delta" for e in events)


def _forks(gateway_url: str) -> float:
    lines = plain_http.get(f"{gateway_url}/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("parrot:forks_total") and SMOLLM in line)


def _engine_prompt_tokens(smollm_gateway) -> float:
    """Prompt tokens the engine was given to compute (fills and generations; a fork's context not included)."""
    lines = plain_http.get(f"{smollm_gateway['engine']}/metrics").text.splitlines()
    return sum(float(line.split()[-1]) for line in lines if line.startswith("vllm:prompt_tokens_total"))


def test_a_stored_conversation_is_forked_from_its_pinned_context(client, gateway_url):
    """Turns 2-4 through previous_response_id run as forks of the conversation pinned on the engine: their
    cached tokens cover the earlier conversation, and the answers are the plain path's (greedy), which gets
    the same conversation as input items with store=false."""
    questions = ["What is the capital of France?", "And of Italy?", "And of Spain?", "Which is the largest?"]
    instructions = "Answer in one short sentence."
    forks_before = _forks(gateway_url)
    pinned, previous = [], None
    for question in questions:
        response = client.responses.create(model=SMOLLM, input=question, previous_response_id=previous,
                                           temperature=0, max_output_tokens=20, instructions=instructions)
        pinned.append(response)
        previous = response.id
    assert _forks(gateway_url) - forks_before == len(questions) - 1
    _assert_plain_path_agrees(client, questions, instructions, pinned)
    client.responses.delete(pinned[-1].id)  # frees its context (the engine's count is not visible from here)


def _assert_plain_path_agrees(client, questions: list[str], instructions: str, turns: list,
                              max_output_tokens: int = 20) -> None:
    """The conversation's ``turns`` answered as the plain path answers it (greedy), which gets the same
    conversation as input items with store=false; each turn's cached tokens cover the conversation before it."""
    history: list = []
    for question, forked in zip(questions, turns):
        history.append({"role": "user", "content": question})
        plain = client.responses.create(model=SMOLLM, input=history, store=False, temperature=0,
                                        max_output_tokens=max_output_tokens, instructions=instructions)
        assert plain.output_text == forked.output_text
        history.append({"role": "assistant", "content": plain.output_text})
    for earlier, later in zip(turns, turns[1:]):
        covered = earlier.usage.input_tokens + earlier.usage.output_tokens
        assert later.usage.input_tokens_details.cached_tokens >= covered - 1, (earlier.usage, later.usage)
        assert later.usage.input_tokens > covered


def test_a_streamed_conversation_is_forked_too(client, gateway_url, smollm_gateway):
    """Streamed turns 2-4 through previous_response_id stream as forks of the pinned conversation: the same text
    as the plain path's (greedy), their cached tokens covering the earlier conversation. A forked turn's own
    context is the next turn's pin (trimmed to where the template renders the answer otherwise), nothing filled
    again: the engine is given only each turn's new tokens to compute."""
    questions = ["What is the capital of France?", "And of Italy?", "And of Spain?", "Which is the largest?"]
    instructions = "Answer in one short sentence."
    forks_before = _forks(gateway_url)
    streamed, previous, computed = [], None, []
    for question in questions:
        before = _engine_prompt_tokens(smollm_gateway)
        with client.responses.stream(model=SMOLLM, input=question, previous_response_id=previous, temperature=0,
                                     max_output_tokens=20, instructions=instructions) as stream:
            deltas = "".join(event.delta for event in stream if event.type == "response.output_text.delta")
            response = stream.get_final_response()
        assert deltas == response.output_text
        computed.append(_engine_prompt_tokens(smollm_gateway) - before)  # the turn's, and the last one's pin
        streamed.append(response)
        previous = response.id
    assert _forks(gateway_url) - forks_before == len(questions) - 1
    for earlier, later, given in zip(streamed[1:], streamed[2:], computed[2:]):  # a fork pinned by a fork
        usage = later.usage
        # followed, not given: the earlier turn's prompt and answer as generated (its end-of-turn token included,
        # which the template renders the same); given: only what follows them, the new message
        assert usage.input_tokens - given == earlier.usage.input_tokens + earlier.usage.output_tokens, computed
        assert usage.input_tokens_details.cached_tokens >= usage.input_tokens - given
    _assert_plain_path_agrees(client, questions, instructions, streamed)
    client.responses.delete(streamed[-1].id)


def test_a_conversation_cut_short_by_max_output_tokens_is_forked_too(client, gateway_url, smollm_gateway):
    """Turns cut short (status incomplete) are pinned as well: the conversation goes on from what they answered.
    Their output has no end-of-turn token, which the template adds: the next fork computes it, and answers as the
    plain path does (greedy)."""
    questions = ["Tell me about Paris.", "And about Rome?", "And about Madrid?"]
    instructions = "Answer at length."
    forks_before = _forks(gateway_url)
    turns, previous, computed = [], None, []
    for question in questions:
        before = _engine_prompt_tokens(smollm_gateway)
        response = client.responses.create(model=SMOLLM, input=question, previous_response_id=previous,
                                           temperature=0, max_output_tokens=6, instructions=instructions)
        assert response.status == "incomplete"
        computed.append(_engine_prompt_tokens(smollm_gateway) - before)
        turns.append(response)
        previous = response.id
    assert _forks(gateway_url) - forks_before == len(questions) - 1
    earlier, later = turns[1:]
    assert later.usage.input_tokens - computed[2] >= earlier.usage.input_tokens  # followed, not filled again
    _assert_plain_path_agrees(client, questions, instructions, turns, max_output_tokens=6)
    client.responses.delete(turns[-1].id)
