"""POST /v1/responses (+ GET, DELETE, cancel, input_items) through the official openai SDK, against a real
gateway on loopback in front of the fake upstream (which echoes the last message, or calls the first tool)."""

from __future__ import annotations

import httpx
import openai
import pydantic
import pytest

from gateway.config import LimitsConfig, QuotasConfig, ResponsesConfig
from tests.support.fake_upstream import MODEL
from tests.support import plain_http

WEATHER = {"type": "function", "name": "get_weather", "description": "Weather for a city.",
           "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}


@pytest.fixture(scope="module")
def client(gateway_url) -> openai.OpenAI:
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-a", max_retries=0, timeout=10) as client:
        yield client


def test_create_with_a_string_input_and_instructions(client, fake_stats):
    response = client.responses.create(model=MODEL, input="hello there", instructions="Be brief.",
                                       max_output_tokens=20, service_tier="flex")

    assert response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == "echo: hello there"
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.usage.output_tokens == 3 and response.usage.input_tokens > 0
    assert response.usage.input_tokens_details.cached_tokens == 0
    assert response.service_tier == "flex" and response.instructions == "Be brief."
    sent = fake_stats()["last_body"]
    assert sent["messages"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello there"}]
    assert sent["max_tokens"] == 20 and sent["service_tier"] == "flex"


def test_a_stored_response_is_found_at_once_and_deleted(client):
    response = client.responses.create(model=MODEL, input="keep me")

    assert client.responses.retrieve(response.id).output_text == "echo: keep me"
    items = client.responses.input_items.list(response.id)
    assert [i.content[0].text if not isinstance(i.content, str) else i.content for i in items.data] == ["keep me"]
    assert client.responses.delete(response.id) is None
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_store_false_keeps_nothing(client):
    response = client.responses.create(model=MODEL, input="forget me", store=False)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response.id)


def test_previous_response_id_over_five_turns(client, fake_stats):
    previous = None
    for turn in range(5):
        response = client.responses.create(model=MODEL, input=f"turn {turn}", previous_response_id=previous)
        assert response.output_text == f"echo: turn {turn}"
        assert response.previous_response_id == previous
        previous = response.id
    messages = fake_stats()["last_body"]["messages"]
    assert [m["role"] for m in messages] == ["user", "assistant"] * 4 + ["user"]
    assert [m["content"] for m in messages[-3:]] == ["turn 3", "echo: turn 3", "turn 4"]


def test_another_keys_response_is_not_found(client, gateway_url):
    response = client.responses.create(model=MODEL, input="mine")
    with openai.OpenAI(base_url=f"{gateway_url}/v1", api_key="sk-b", max_retries=0, timeout=10) as other:
        with pytest.raises(openai.NotFoundError):
            other.responses.retrieve(response.id)
        with pytest.raises(openai.NotFoundError) as caught:
            other.responses.create(model=MODEL, input="yours?", previous_response_id=response.id)
    assert caught.value.body["param"] == "previous_response_id"


def test_a_function_tool_round_trip(client, fake_stats):
    first = client.responses.create(model=MODEL, input="weather in Paris?", tools=[WEATHER])

    call = first.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.arguments == '{"x": 1}'
    assert call.call_id and call.id.startswith("fc_")
    second = client.responses.create(
        model=MODEL, previous_response_id=first.id, tools=[WEATHER], tool_choice="none",
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21C"}])

    assert second.output_text == "echo: sunny, 21C"
    messages = fake_stats()["last_body"]["messages"]
    assert messages[-2]["tool_calls"][0]["id"] == call.call_id
    assert messages[-1] == {"role": "tool", "tool_call_id": call.call_id, "content": "sunny, 21C"}


def test_item_input_with_history_given_by_the_client(client, fake_stats):
    response = client.responses.create(model=MODEL, input=[
        {"role": "developer", "content": "Answer in French."},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "rain"}], tools=[WEATHER],
        tool_choice={"type": "function", "name": "get_weather"}, parallel_tool_calls=False)

    assert response.output[0].type == "function_call"
    sent = fake_stats()["last_body"]
    assert [m["role"] for m in sent["messages"]] == ["system", "user", "assistant", "tool"]
    assert sent["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert sent["parallel_tool_calls"] is False


def test_malformed_items_name_their_path(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[{"role": "user", "content": "ok"},
                                                    {"type": "function_call_output", "output": "x"}])
    assert caught.value.body["param"] == "input[1].call_id"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input=[{"type": "message", "role": "user", "content": 3}])
    assert caught.value.body["param"] == "input[0].content"
    with pytest.raises(openai.BadRequestError) as caught:
        client.responses.create(model=MODEL, input="x", tools=[{"type": "web_search"}])
    assert caught.value.body["param"] == "tools[0].type"
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="no-such-model", input="x")


class Answer(pydantic.BaseModel):
    city: str
    population: int


def test_parse_with_a_pydantic_model(client, fake_stats):
    text = '{"city": "Paris", "population": 2100000}'
    response = client.responses.parse(model=MODEL, input="Paris?", text_format=Answer,
                                      extra_body={"fake": {"text": text}})

    assert response.output_parsed == Answer(city="Paris", population=2100000)
    response_format = fake_stats()["last_body"]["response_format"]
    assert response_format["type"] == "json_schema" and response_format["json_schema"]["strict"] is True
    assert response_format["json_schema"]["schema"]["required"] == ["city", "population"]


def test_stream_events_in_order(client):
    with client.responses.stream(model=MODEL, input="one two three") as stream:
        events = list(stream)
        final = stream.get_final_response()

    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[2:4] == ["response.output_item.added", "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.completed"]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "echo: one two three"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert final.output_text == "echo: one two three"
    assert final.usage.output_tokens == 4 and final.usage.input_tokens_details.cached_tokens == 0
    assert client.responses.retrieve(final.id).status == "completed"


def test_stream_a_tool_call_with_its_arguments(client):
    with client.responses.stream(model=MODEL, input="weather?", tools=[WEATHER]) as stream:
        events = list(stream)
        final = stream.get_final_response()

    kinds = [e.type for e in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    assert "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta") == '{"x": 1}'
    assert final.output[0].type == "function_call" and final.output[0].arguments == '{"x": 1}'


def test_background_polled(client, wait_until):
    response = client.responses.create(model=MODEL, input="in the back", background=True)

    assert response.status in ("queued", "in_progress") and response.background is True
    wait_until(lambda: client.responses.retrieve(response.id).status == "completed", timeout_s=10)
    assert client.responses.retrieve(response.id).output_text == "echo: in the back"


def test_a_follow_up_on_a_running_background_response_waits_for_it(client):
    running = client.responses.create(model=MODEL, input="first", background=True,
                                      extra_body={"fake": {"delay_s": 0.5}})
    follow_up = client.responses.create(model=MODEL, input="second", previous_response_id=running.id)

    assert follow_up.output_text == "echo: second"
    assert client.responses.retrieve(running.id).output_text == "echo: first"


def test_background_cancelled(client, fake_stats, wait_until):
    slow = client.responses.create(model=MODEL, input="slow", background=True, extra_body={"fake": {"delay_s": 30}})
    wait_until(lambda: fake_stats()["last_body"]["messages"][-1]["content"] == "slow", timeout_s=5)
    abandoned = fake_stats()["requests_abandoned"]

    cancelled = client.responses.cancel(slow.id)

    assert cancelled.status == "cancelled" and client.responses.retrieve(slow.id).status == "cancelled"
    wait_until(lambda: fake_stats()["requests_abandoned"] == abandoned + 1, timeout_s=5)  # the engine's work too
    with pytest.raises(openai.BadRequestError):  # only background responses are cancelled
        client.responses.cancel(client.responses.create(model=MODEL, input="fg").id)


def test_a_stream_the_engine_drops_ends_failed(client):
    with client.responses.stream(model=MODEL, input="a b c d e", extra_body={"fake": {"die_after": 3}}) as stream:
        events = list(stream)

    assert events[-1].type == "response.failed" and events[-1].response.error.message
    assert client.responses.retrieve(events[-1].response.id).status == "failed"


def test_the_raw_stream_names_each_event(gateway_url):
    with plain_http.stream("POST", f"{gateway_url}/v1/responses",
                      json={"model": MODEL, "input": "hi", "stream": True}) as answer:
        lines = [line for line in answer.iter_lines() if line]
    assert answer.headers["content-type"].startswith("text/event-stream")
    names = [line.removeprefix("event: ") for line in lines if line.startswith("event: ")]
    assert names == ["response.created", "response.in_progress", "response.output_item.added",
                     "response.content_part.added", "response.output_text.delta", "response.output_text.delta",
                     "response.output_text.done", "response.content_part.done", "response.output_item.done",
                     "response.completed"]
    assert len([line for line in lines if line.startswith("data: {")]) == len(names)


def test_quotas_apply_as_on_chat(start_gateway):
    url = start_gateway(quotas=QuotasConfig(requests_per_minute=1))
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-q", max_retries=0, timeout=10) as client:
        client.responses.create(model=MODEL, input="one")
        with pytest.raises(openai.RateLimitError):
            client.responses.create(model=MODEL, input="two")


def test_a_stream_is_charged_to_its_keys_token_quota(start_gateway):
    url = start_gateway(quotas=QuotasConfig(tokens_per_minute=12, concurrent_requests=1))
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-t", max_retries=0, timeout=10) as client:
        with client.responses.stream(model=MODEL, input="a b c d e f g h i j k l m n") as stream:
            assert stream.get_final_response().usage.total_tokens > 12
        with pytest.raises(openai.RateLimitError) as caught:  # the stream's usage was charged: the bucket is in debt
            client.responses.create(model=MODEL, input="more")
    assert caught.value.body["type"] == "tokens"


def test_sizes_are_capped(start_gateway):
    url = start_gateway(limits=LimitsConfig(max_body_bytes=2000), responses=ResponsesConfig(max_response_bytes=4000))
    answer = plain_http.post(f"{url}/v1/responses", json={"model": MODEL, "input": "x" * 5000})
    assert answer.status_code == 413
    first = plain_http.post(f"{url}/v1/responses", json={"model": MODEL, "input": "y" * 1200}).json()
    answer = plain_http.post(f"{url}/v1/responses", json={"model": MODEL, "input": "z" * 1200,
                                                     "previous_response_id": first["id"]})
    assert answer.status_code == 413 and answer.json()["error"]["param"] == "previous_response_id"


def test_a_client_that_leaves_cancels_the_engines_work(gateway_url, fake_stats, wait_until):
    abandoned = fake_stats()["requests_abandoned"]
    with pytest.raises(httpx.ReadTimeout):
        plain_http.post(f"{gateway_url}/v1/responses", timeout=0.5,
                   json={"model": MODEL, "input": "wait", "fake": {"delay_s": 30}})
    wait_until(lambda: fake_stats()["requests_abandoned"] == abandoned + 1, timeout_s=5)


def test_the_store_forgets_the_oldest_beyond_its_bounds_and_the_idle_after_its_ttl():
    from gateway.responses.store import ResponseStore, StoredResponse
    from gateway.domain_errors import NotFound
    from wire.responses import MessageItem, Response

    now = [0.0]
    store = ResponseStore(ResponsesConfig(max_stored=2, ttl_s=10), clock=lambda: now[0])
    made = []
    for i in range(3):
        made.append(StoredResponse(Response(model="m"), [MessageItem(role="user", content=f"q{i}")], []))
        store.put("alice", made[-1])
    with pytest.raises(NotFound):
        store.get("alice", made[0].response.id)  # the oldest went
    with pytest.raises(NotFound):
        store.get("bob", made[2].response.id)  # another key's
    now[0] = 5.0
    store.get("alice", made[2].response.id)  # read: touched
    now[0] = 12.0
    store.sweep()
    assert len(store) == 1 and store.get("alice", made[2].response.id) is made[2]


def test_a_background_response_holds_its_keys_seat_until_cancelled(start_gateway):
    url = start_gateway(quotas=QuotasConfig(concurrent_requests=1))
    with openai.OpenAI(base_url=f"{url}/v1", api_key="sk-seat", max_retries=0, timeout=10) as client:
        slow = client.responses.create(model=MODEL, input="slow", background=True,
                                       extra_body={"fake": {"delay_s": 30}})
        with pytest.raises(openai.RateLimitError):
            client.responses.create(model=MODEL, input="meanwhile")
        assert client.responses.cancel(slow.id).status == "cancelled"
        assert client.responses.create(model=MODEL, input="after").output_text == "echo: after"
        # Cancelled at once, before its task ever ran: settled all the same.
        quick = client.responses.create(model=MODEL, input="x", background=True, extra_body={"fake": {"delay_s": 30}})
        assert client.responses.cancel(quick.id).status == "cancelled"
        assert client.responses.create(model=MODEL, input="again").output_text == "echo: again"


def test_input_items_page_in_either_order(client):
    response = client.responses.create(model=MODEL, input=[{"role": "user", "content": f"m{i}"} for i in range(5)])

    newest = client.responses.input_items.list(response.id, limit=2)
    assert [i.content for i in newest.data] == ["m4", "m3"] and newest.has_more
    rest = client.responses.input_items.list(response.id, order="asc", after=newest.data[0].id)
    assert rest.data == [] and not rest.has_more
    oldest = client.responses.input_items.list(response.id, order="asc", limit=3)
    assert [i.content for i in oldest.data] == ["m0", "m1", "m2"] and oldest.first_id == oldest.data[0].id
    following = client.responses.input_items.list(response.id, order="asc", after=oldest.last_id)
    assert [i.content for i in following.data] == ["m3", "m4"]
    with pytest.raises(openai.BadRequestError):
        client.responses.create(model=MODEL, input="x", tool_choice="required")
