"""Structured output and tool calls with LangChain and the openai SDK, through a real gateway to a real
builtin SmolLM2-135M engine process: the grammar makes even a 135M model return schema-valid objects
and well-formed tool calls."""

from __future__ import annotations

import json

import openai
import pydantic
import pytest
from langchain_core.messages import HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI
from tests.support.models import SMOLLM

MODEL = SMOLLM
# Every test here loads a model in an engine process (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.timeout(300), pytest.mark.model, pytest.mark.subprocess]


class Person(pydantic.BaseModel):
    """A person mentioned in the text."""

    name: str = pydantic.Field(max_length=20)
    age: int = pydantic.Field(ge=0, le=150)


@tool
def get_weather(city: str) -> str:
    """Get the current weather in a city."""
    return f"Sunny and 24 C in {city}."


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}}, "required": ["city"]},
    },
}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def smollm_url(smollm_gateway) -> str:
    return smollm_gateway["gateway"]


@pytest.fixture(scope="module")
def llm(smollm_url) -> ChatOpenAI:
    return ChatOpenAI(base_url=f"{smollm_url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=48,
                      max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def client(smollm_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{smollm_url}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


@pytest.mark.parametrize("method", ["json_schema", "function_calling", "json_mode"])
def test_with_structured_output_returns_a_valid_instance(llm, method):
    structured = llm.with_structured_output(Person, method=method)
    # json_mode sends no schema, so the prompt has to ask for the keys (as OpenAI's docs require).
    person = structured.invoke("Alice is 31 years old. Describe her as a JSON object with keys name and age.")
    assert isinstance(person, Person)


def test_bind_tools_round_trip(llm):
    question = HumanMessage("What is the weather in Paris?")
    call_message = llm.bind_tools([get_weather], tool_choice="get_weather").invoke([question])
    [call] = call_message.tool_calls
    assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert call["id"].startswith("call_")
    assert call_message.response_metadata["finish_reason"] == "tool_calls"

    result = get_weather.invoke(call)  # a ToolMessage answering that call id
    # SmolLM2-135M given the tools again tends to repeat its call; "none" has it answer from the result.
    answer = llm.bind_tools([get_weather], tool_choice="none").invoke([question, call_message, result])

    assert answer.content and not answer.tool_calls
    assert answer.response_metadata["finish_reason"] in ("stop", "length")


def test_streamed_tool_call_deltas_assemble_into_the_same_call(client):
    body = dict(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="required", temperature=0, max_tokens=48)
    whole = client.chat.completions.create(**body).choices[0]
    [expected] = whole.message.tool_calls
    assert whole.finish_reason == "tool_calls" and whole.message.content is None
    assert expected.type == "function" and expected.id.startswith("call_")

    deltas, finish_reasons = [], []
    for chunk in client.chat.completions.create(**body, stream=True):
        for choice in chunk.choices:
            deltas += choice.delta.tool_calls or []
            finish_reasons.append(choice.finish_reason)
    first, rest = deltas[0], deltas[1:]
    assert (first.index, first.type, first.function.name, first.function.arguments) == (0, "function", "get_weather", "")
    assert first.id.startswith("call_")
    assert rest and all(d.index == 0 and d.id is None and d.function.name is None for d in rest)
    arguments = "".join(d.function.arguments for d in rest)
    assert arguments == expected.function.arguments
    assert isinstance(json.loads(arguments)["city"], str)
    assert finish_reasons[-1] == "tool_calls"


def test_tool_choice_none_answers_in_text(client):
    reply = client.chat.completions.create(model=MODEL, messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="none",
                                           temperature=0, max_tokens=24).choices[0]
    assert reply.message.tool_calls is None and reply.message.content
    assert reply.finish_reason in ("stop", "length")


def test_invalid_schema_is_a_400(client):
    bad = {"type": "json_schema", "json_schema": {"name": "bad", "schema": {"type": "strang"}}}
    with pytest.raises(openai.BadRequestError) as error:
        client.chat.completions.create(model=MODEL, messages=QUESTION, response_format=bad, max_tokens=8)
    assert "strang" in str(error.value) and error.value.body["param"] == "response_format"
