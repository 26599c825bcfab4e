"""The ``parrot`` extension on the Responses and Messages APIs on a real builtin engine process (SmolLM2-135M,
greedy): a semantic call answers exactly as the equivalent plain chat call does (the same prompt, token for token),
and its output variable feeds a chat call, and a chat call's feeds it, as between chat calls."""

from __future__ import annotations

import anthropic
import openai
import pytest

from tests.support.models import SMOLLM

pytestmark = [pytest.mark.model, pytest.mark.subprocess]  # smollm_gateway: `make test-fast` leaves it unimported

SYSTEM = "Answer in one short sentence."
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def client(smollm_gateway) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{smollm_gateway['gateway']}/v1", api_key="unused", max_retries=0, timeout=120) as c:
        yield c


def chat(client: openai.OpenAI, content: str, **extra) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(model=SMOLLM, max_tokens=24, **GREEDY, **extra, messages=[
        {"role": "system", "content": SYSTEM}, {"role": "user", "content": content}])


def test_a_semantic_response_answers_as_the_equivalent_chat_call_and_feeds_one(client):
    semantic = client.responses.create(model=SMOLLM, input="What is the capital of {{country}}?", instructions=SYSTEM,
                                       max_output_tokens=24, **GREEDY,
                                       extra_body={"parrot": {"vars": {"country": {"value": "France"}}}})
    plain = chat(client, "What is the capital of France?")

    assert semantic.output_text == plain.choices[0].message.content and "Paris" in semantic.output_text
    assert semantic.usage.input_tokens == plain.usage.prompt_tokens

    output = semantic.model_extra["parrot"]["output"]["id"]
    consumer = chat(client, "Say it again: {{answer}}", extra_body={"parrot": {"vars": {"answer": {"id": output}}}})
    assert consumer.choices[0].message.content == chat(client, f"Say it again: {plain.choices[0].message.content}"
                                                       ).choices[0].message.content


def test_a_chat_calls_output_feeds_a_response_and_a_message(client, smollm_gateway):
    producer = chat(client, "Name the capital of Italy.", extra_body={"parrot": {"output": "capital"}})
    output, text = producer.model_extra["parrot"]["output"]["id"], producer.choices[0].message.content

    consumed = client.responses.create(model=SMOLLM, input="Describe {{place}}", instructions=SYSTEM,
                                       max_output_tokens=24, **GREEDY,
                                       extra_body={"parrot": {"vars": {"place": {"id": output}}}})
    assert consumed.output_text == chat(client, f"Describe {text}").choices[0].message.content

    with anthropic.Anthropic(base_url=smollm_gateway["gateway"], api_key="unused", max_retries=0, timeout=120) as messages:
        message = messages.messages.create(model=SMOLLM, max_tokens=24, system=SYSTEM,
                                           messages=[{"role": "user", "content": "Describe {{place}}"}],
                                           extra_body={**GREEDY, "parrot": {"vars": {"place": {"id": output}}}})
    assert message.content[0].text == consumed.output_text
