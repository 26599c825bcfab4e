"""The ``parrot`` extension on POST /v1/responses and /v1/messages: the translated chat body runs on the chat path's
semantic path, so its placeholders bind as a chat request's do and its output variable is another call's input
either way. Through the real openai and anthropic SDKs, against a real gateway in front of the fake upstream
(which echoes the last message: what it echoes is what the engine was sent)."""

from __future__ import annotations

import openai
import pytest

from tests.support.fake_upstream import MODEL
from tests.support import plain_http


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-a", max_retries=0, timeout=10) as client:
        yield client


def value_of(gateway_url: str, var_id: str, key: str = "sk-a") -> str:
    answer = plain_http.get(f"{gateway_url}/v1/vars/{var_id}", params={"wait": "true", "timeout": 10},
                       headers={"authorization": f"Bearer {key}"}, timeout=15)
    answer.raise_for_status()
    return answer.json()["value"]


def test_a_responses_call_binds_placeholders_and_its_output_feeds_a_chat_call(client, gateway_url, fake_stats):
    response = client.responses.create(model=MODEL, input="Translate {{word}}", instructions="Be {{tone}}.",
                                       extra_body={"parrot": {"vars": {"word": {"value": "cat"},
                                                                        "tone": {"value": "brief"}},
                                                              "output": "translation"}})

    assert response.output_text == "echo: Translate cat"
    assert fake_stats()["last_body"]["messages"] == [{"role": "system", "content": "Be brief."},
                                                     {"role": "user", "content": "Translate cat"}]
    parrot = response.model_extra["parrot"]
    assert parrot["output"]["name"] == "translation"
    assert value_of(gateway_url, parrot["output"]["id"]) == "echo: Translate cat"

    # The same session: a chat request consumes the Responses call's output variable by id.
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Again: {{t}}"}],
                                          extra_body={"parrot": {"vars": {"t": {"id": parrot["output"]["id"]}}}})
    assert chat.choices[0].message.content == "echo: Again: echo: Translate cat"


def test_a_chat_calls_output_feeds_a_responses_call_and_the_stored_turn_holds_its_value(client, fake_stats):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "dog"}],
                                          extra_body={"parrot": {"output": "animal"}})
    animal = chat.model_extra["parrot"]["output"]["id"]

    first = client.responses.create(model=MODEL, input="About {{a}}", extra_body={"parrot": {"vars": {"a": {"id": animal}}}})
    assert first.output_text == "echo: About echo: dog"
    # Stored as the model read it: the next turn (plain) and its input items hold the value, not the placeholder.
    assert client.responses.input_items.list(first.id).data[0].content == "About echo: dog"
    second = client.responses.create(model=MODEL, input="more", previous_response_id=first.id)
    assert second.output_text == "echo: more"
    assert [m["content"] for m in fake_stats()["last_body"]["messages"]] == ["About echo: dog", "echo: About echo: dog",
                                                                              "more"]


def test_a_streamed_responses_call_carries_its_variables_from_the_first_event(client, gateway_url):
    with client.responses.stream(model=MODEL, input="Say {{x}}", extra_body={
            "parrot": {"vars": {"x": {"value": "hi"}}, "output": "said"}}) as stream:
        events = list(stream)
        final = stream.get_final_response()

    assert events[0].type == "response.created"
    parrot = events[0].response.model_extra["parrot"]
    assert final.output_text == "echo: Say hi" == value_of(gateway_url, parrot["output"]["id"])
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "echo: Say hi"
    assert final.usage.output_tokens > 0 and client.responses.retrieve(final.id).output_text == "echo: Say hi"


def test_wait_false_answers_202_with_the_output_variable(http, gateway_url):
    answer = http.post(f"{gateway_url}/v1/responses", headers={"authorization": "Bearer sk-a"}, json={
        "model": MODEL, "input": "later {{v}}", "parrot": {"wait": False, "vars": {"v": {"value": "on"}}}})

    assert answer.status_code == 202
    assert value_of(gateway_url, answer.json()["parrot"]["output"]["id"]) == "echo: later on"


def test_a_background_response_runs_its_semantic_call(client, wait_until):
    queued = client.responses.create(model=MODEL, input="bg {{v}}", background=True,
                                     extra_body={"parrot": {"vars": {"v": {"value": "job"}}}})
    wait_until(lambda: client.responses.retrieve(queued.id).status not in ("queued", "in_progress"))
    done = client.responses.retrieve(queued.id)
    assert done.status == "completed" and done.output_text == "echo: bg job"
    assert done.model_extra["parrot"]["output"]["id"].startswith("var")


@pytest.mark.parametrize(("parrot", "extra", "param"), [
    ("not an object", {}, "parrot"),
    ({"vars": {}}, {}, "parrot.vars"),  # {{x}} unbound
    ({"vars": {"x": {"value": "a", "id": "var_1"}}}, {}, "parrot.vars.x"),
    ({"wait": False, "vars": {"x": {"value": "a"}}}, {"background": True}, "parrot.wait"),
    ({"wait": False, "vars": {"x": {"value": "a"}}}, {"stream": True}, "parrot.wait"),
    ({"vars": {"x": {"value": "a"}}, "bogus": 1}, {}, "parrot"),
])
def test_a_bad_extension_is_a_400_naming_it(http, gateway_url, parrot, extra, param):
    answer = http.post(f"{gateway_url}/v1/responses", headers={"authorization": "Bearer sk-a"},
                       json={"model": MODEL, "input": "{{x}}", "parrot": parrot, **extra})

    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param


def test_another_keys_semantic_response_and_variables_are_404(client, gateway_url):
    response = client.responses.create(model=MODEL, input="mine {{v}}", extra_body={"parrot": {"vars": {"v": {"value": "x"}}}})
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-b", max_retries=0, timeout=10) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError):  # its variables are its key's too
            other.responses.create(model=MODEL, input="{{v}}", extra_body={
                "parrot": {"vars": {"v": {"id": response.model_extra["parrot"]["output"]["id"]}}}})


def test_messages_bind_placeholders_whole_and_streamed(gateway_url, fake_stats):
    import anthropic  # here, not at the top: seconds of import for each worker that collects this module
    with anthropic.Anthropic(base_url=gateway_url, api_key="sk-a", max_retries=0, timeout=10) as client:
        message = client.messages.create(model=MODEL, max_tokens=20, system="Be {{tone}}.",
                                         messages=[{"role": "user", "content": "Hi {{name}}"}],
                                         extra_body={"parrot": {"vars": {"name": {"value": "Ada"},
                                                                         "tone": {"value": "kind"}}, "output": "greeting"}})
        assert message.content[0].text == "echo: Hi Ada"
        assert fake_stats()["last_body"]["messages"][0] == {"role": "system", "content": "Be kind."}
        greeting = message.model_extra["parrot"]["output"]["id"]
        assert value_of(gateway_url, greeting) == "echo: Hi Ada"

        with client.messages.stream(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "Re: {{g}}"}],
                                    extra_body={"parrot": {"vars": {"g": {"id": greeting}}}}) as stream:
            events = list(stream)
            final = stream.get_final_message()
        assert events[0].type == "message_start" and "parrot" in events[0].message.model_extra
        assert final.content[0].text == "echo: Re: echo: Hi Ada"

        with pytest.raises(anthropic.BadRequestError) as caught:
            client.messages.create(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "{{nope}}"}],
                                   extra_body={"parrot": {}})
        assert "parrot.vars" in caught.value.message


def test_a_semantic_turn_continues_a_stored_conversation(client, fake_stats):
    first = client.responses.create(model=MODEL, input="start")
    second = client.responses.create(model=MODEL, input="then {{v}}", previous_response_id=first.id,
                                     extra_body={"parrot": {"vars": {"v": {"value": "this"}}}})

    assert second.output_text == "echo: then this" and second.previous_response_id == first.id
    assert [m["content"] for m in fake_stats()["last_body"]["messages"]] == ["start", "echo: start", "then this"]


def test_a_streamed_semantic_call_with_tools_comes_whole_in_each_api(client, gateway_url):
    import anthropic
    tool = {"type": "function", "name": "lookup", "parameters": {"type": "object", "properties": {}}}
    with client.responses.stream(model=MODEL, input="Find {{what}}", tools=[tool], tool_choice="required",
                                 extra_body={"parrot": {"vars": {"what": {"value": "it"}}}}) as stream:
        final = stream.get_final_response()
    assert final.output[0].type == "function_call" and final.output[0].name == "lookup"

    with anthropic.Anthropic(base_url=gateway_url, api_key="sk-a", max_retries=0, timeout=10) as messages:
        with messages.messages.stream(model=MODEL, max_tokens=20, messages=[{"role": "user", "content": "Find {{w}}"}],
                                      tools=[{"name": "lookup", "input_schema": {"type": "object", "properties": {}}}],
                                      tool_choice={"type": "any"},
                                      extra_body={"parrot": {"vars": {"w": {"value": "it"}}}}) as stream:
            message = stream.get_final_message()
    assert message.content[0].type == "tool_use" and message.content[0].name == "lookup"
