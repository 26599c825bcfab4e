"""LangChain over the Responses and Messages APIs: ``ChatOpenAI(use_responses_api=True)`` and ``ChatAnthropic``
with their base URL at the gateway (in front of the fake upstream, which echoes the last message or calls the
first tool): invoke, stream, a tool round trip, structured output."""

from __future__ import annotations

import pydantic
import pytest

from tests.support.fake_upstream import MODEL


def get_weather(x: int) -> str:
    """The weather at x."""
    return "sunny"


class Answer(pydantic.BaseModel):
    a: int


def text_of(message) -> str:
    content = message.content
    return content if isinstance(content, str) else "".join(b.get("text", "") for b in content if isinstance(b, dict))


# LangChain and its providers are imported where they are used, not at the top: every xdist worker of
# `make test-fast` imports every collected module, and langchain_core and anthropic take seconds to import.


@pytest.fixture(params=["responses", "messages"])
def llm(request, gateway_url):
    if request.param == "responses":
        from langchain_openai import ChatOpenAI

        return ChatOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", model=MODEL, use_responses_api=True,
                          max_retries=0, timeout=15)
    from langchain_anthropic import ChatAnthropic

    return ChatAnthropic(base_url=gateway_url, api_key="unused", model=MODEL, max_tokens=32, max_retries=0,
                         timeout=15)


def test_invoke_and_stream(llm):
    assert text_of(llm.invoke("hello there")) == "echo: hello there"
    assert "".join(text_of(chunk) for chunk in llm.stream("one two")) == "echo: one two"


def test_a_tool_round_trip(llm):
    from langchain_core.messages import HumanMessage, ToolMessage

    called = llm.bind_tools([get_weather]).invoke("weather?")

    assert [(c["name"], c["args"]) for c in called.tool_calls] == [("get_weather", {"x": 1})]
    answer = llm.invoke([HumanMessage("weather?"), called, ToolMessage("sunny", tool_call_id=called.tool_calls[0]["id"])])
    assert text_of(answer) == "echo: sunny"


def test_structured_output(llm):
    structured = llm.with_structured_output(Answer, method="json_schema")
    assert structured.invoke("a?", extra_body={"fake": {"text": '{"a": 3}'}}) == Answer(a=3)
