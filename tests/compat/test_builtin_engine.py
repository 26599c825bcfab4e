"""LangChain and the openai SDK through a real gateway to a real builtin engine process on SmolLM2-135M.

The engine is started as `parrot engine --gateway-url ...` so it registers itself like in production; the
gateway therefore runs semantic calls with the engine's context primitives (shared-prefix forking).
"""

from __future__ import annotations


import openai
import pytest
from langchain_core.output_parsers import StrOutputParser
from langchain_core.prompts import ChatPromptTemplate
from langchain_core.runnables import RunnableParallel
from langchain_openai import ChatOpenAI

from compat.frontend import Output, semantic_function
from compat.langchain import ParrotChatOpenAI
from compat.openai import Session
from tests.support.models import SMOLLM

# Every test here loads a model in an engine process (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.model, pytest.mark.subprocess]

MODEL = SMOLLM


@pytest.fixture(scope="module")
def gateway_url(smollm_gateway) -> str:
    """The session's gateway with a builtin SmolLM2 engine process registered (tests/conftest.py)."""
    return smollm_gateway["gateway"]


def settings(gateway_url: str) -> dict:
    return dict(base_url=f"{gateway_url}/v1", api_key="unused", model=MODEL, temperature=0, max_tokens=16,
                max_retries=0, timeout=120)


STEPS = (
    "Name one animal that lives in {topic}. Answer with just the animal.",
    "Describe this animal in one short sentence: {animal}",
    "Give a two-word title for this sentence: {sentence}",
)


def pipeline(llm):
    """topic -> animal -> sentence -> title: three LCEL steps, each feeding the next."""
    animal, sentence, title = (ChatPromptTemplate.from_template(t) | llm | StrOutputParser() for t in STEPS)
    return {"animal": animal} | RunnableParallel(sentence=sentence) | title


def test_three_step_chain_as_a_dag_matches_step_by_step(gateway_url):
    plain = ChatOpenAI(**settings(gateway_url))
    animal = plain.invoke(STEPS[0].format(topic="the ocean")).content
    sentence = plain.invoke(STEPS[1].format(animal=animal)).content
    expected = plain.invoke(STEPS[2].format(sentence=sentence)).content
    assert animal.strip() and sentence.strip() and expected.strip()

    llm = ParrotChatOpenAI(**settings(gateway_url))
    with llm.session() as session:
        topic = session.variable("topic")
        handle = pipeline(llm.in_session(session)).invoke({"topic": str(topic)})
        # The whole chain is in the gateway's graph before any step could start (its root input is unset).
        views = session.variables()
        assert len(views) == 4 and not any(v["ready"] for v in views)

        topic.set("the ocean")

        assert llm.resolve(handle) == expected
        values = [v["value"] for v in session.variables()]
        assert animal in values and sentence in values


def test_chat_openai_invoke_stream_and_batch(gateway_url):
    llm = ChatOpenAI(**settings(gateway_url))
    question = "What is the capital of France?"

    answer = llm.invoke(question)
    chunks = list(llm.stream(question, stream_usage=True))
    batch = llm.batch([question, "Name a colour."])

    assert "Paris" in answer.content
    assert "".join(c.content for c in chunks) == answer.content
    usage = [c.usage_metadata for c in chunks if c.usage_metadata]
    assert len(usage) == 1 and usage[0]["output_tokens"] == answer.usage_metadata["output_tokens"] > 0
    assert usage[0]["input_tokens"] == answer.usage_metadata["input_tokens"] > 0
    assert batch[0].content == answer.content
    assert batch[1].content and batch[1].content != answer.content


@semantic_function(model=MODEL, temperature=0)
def capital(country, answer: Output(max_tokens=8)):
    """You are a geography expert. Answer with the name of the capital city only, nothing else.
    Country:
    {{country}}
    Capital:{{answer}}"""


def test_semantic_function_matches_a_plain_completion(gateway_url):
    client = openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="unused", max_retries=0, timeout=120)
    prompt = capital.template.replace("{{input:country}}", "France").replace("{{output:answer}}", "")
    expected = client.completions.create(model=MODEL, prompt=prompt, temperature=0,
                                         max_tokens=8).choices[0].text

    with Session(client):
        answer = capital("France")

        assert answer.get(timeout=60) == expected
    assert expected.strip()
