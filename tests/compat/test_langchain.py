"""LangChain against a real gateway over the fake upstream: plain ChatOpenAI unchanged, and ParrotChatOpenAI
chains submitted as a DAG (the fake answers "echo: " + the last user message)."""

from __future__ import annotations

import pytest

from compat.openai import VARIABLE_PLACEHOLDER
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve


# LangChain (and compat.langchain, which imports it) is imported where it is used, not at the top: every xdist worker
# of `make test-fast` imports every collected module, and langchain_core takes a second or two to import.


@pytest.fixture(scope="module")
def plain_llm(gateway_url) -> ChatOpenAI:
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", model=MODEL, temperature=0, max_retries=0,
                      timeout=15)


@pytest.fixture(scope="module")
def llm(gateway_url) -> ParrotChatOpenAI:
    from compat.langchain import ParrotChatOpenAI

    return ParrotChatOpenAI(base_url=f"{gateway_url}/v1", api_key="unused", model=MODEL, temperature=0,
                            max_retries=0, timeout=15)


def three_steps(llm):
    """topic -> outline -> draft -> title, each step an ordinary LCEL prompt | llm | parser."""
    from langchain_core.output_parsers import StrOutputParser
    from langchain_core.prompts import ChatPromptTemplate
    from langchain_core.runnables import RunnableParallel

    outline = ChatPromptTemplate.from_template("outline {topic}") | llm | StrOutputParser()
    draft = ChatPromptTemplate.from_template("draft from {outline}") | llm | StrOutputParser()
    title = ChatPromptTemplate.from_template("title for {draft}") | llm | StrOutputParser()
    return {"outline": outline} | RunnableParallel(draft=draft) | title


def test_plain_chat_openai_invoke_stream_batch(plain_llm):
    assert plain_llm.invoke("hello").content == "echo: hello"
    chunks = list(plain_llm.stream("a b c", stream_usage=True))
    assert "".join(c.content for c in chunks) == "echo: a b c"
    assert sum(c.usage_metadata["output_tokens"] for c in chunks if c.usage_metadata) == 4
    assert [m.content for m in plain_llm.batch(["x", "y"])] == ["echo: x", "echo: y"]


def test_invoke_returns_a_handle_without_waiting(llm):
    from langchain_core.messages import AIMessage

    with llm.session() as session:
        gate = session.variable("gate")
        message = llm.in_session(session).invoke(f"about {gate}", parrot_output="answer")

        assert isinstance(message, AIMessage)
        assert VARIABLE_PLACEHOLDER.fullmatch(message.content)
        answer = llm.variable(message)
        assert message.response_metadata["parrot"]["output"] == {"id": answer.id, "name": "answer"}
        assert not answer.ready

        gate.set("tea")

        assert llm.resolve(message) == "echo: about tea"


def test_a_three_step_chain_is_submitted_as_a_dag(llm):
    with llm.session() as session:
        topic = session.variable("topic")
        chain = three_steps(llm.in_session(session))

        handle = chain.invoke({"topic": str(topic)})

        # All three calls are in the gateway's graph, none has run: the root input is not set.
        views = session.variables()
        assert len(views) == 4 and not any(v["ready"] for v in views)
        topic.set("tea")
        assert (chain | llm.resolver()).invoke({"topic": "tea"}) == llm.resolve(handle)
        assert llm.resolve(handle) == "echo: title for echo: draft from echo: outline tea"


def test_parrot_vars_and_wait_mode(llm):
    with llm.session() as session:
        base = session.variable("base", value="coffee")
        waiting = llm.in_session(session).bind(parrot_wait=True, parrot_vars={"drink": "tea", "other": base})

        message = waiting.invoke("{{drink}} or {{other}}")

        assert message.content == "echo: tea or coffee"
        assert message.response_metadata["parrot"]["session_id"] == session.id


def test_streaming_a_handle_streams_the_placeholder(llm):
    text = "".join(chunk.content for chunk in llm.stream("streamed"))

    assert VARIABLE_PLACEHOLDER.fullmatch(text)
    assert llm.resolve(text) == "echo: streamed"


async def test_async_chain_and_aresolve(llm):
    handles = await three_steps(llm).abatch([{"topic": "a"}, {"topic": "b"}])

    assert [await llm.aresolve(h) for h in handles] == [
        f"echo: title for echo: draft from echo: outline {t}" for t in "ab"]
