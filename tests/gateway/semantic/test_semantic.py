"""Semantic variables over an upstream engine (text substitution): the graph's behaviour, fast.

The fake upstream echoes the last user message ("echo: ..."), so a consumer's output shows exactly
which values reached it.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import pytest

from gateway.config import SemanticConfig, UpstreamConfig
from gateway.semantic.call_spec import CallSpec
from gateway.semantic.graph import LATENCY_PRIORITY, Call, Session, VariableFailed
from tests.support.waiting import wait_until
from tests.support.fake_upstream import MODEL


def chat(text: str, parrot: dict, **extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": text}], "parrot": parrot, **extra}


@pytest.fixture
def gw(gateway_url) -> httpx.Client:
    with httpx.Client(base_url=gateway_url, timeout=20) as client:
        yield client


@pytest.fixture
def session(gw) -> str:
    session_id = gw.post("/v1/sessions").json()["id"]
    yield session_id
    gw.delete(f"/v1/sessions/{session_id}")


def new_var(gw, session, name=None, value=None) -> str:
    response = gw.post("/v1/vars", json={"session_id": session, "name": name, "value": value})
    assert response.status_code == 201, response.text
    return response.json()["id"]


def test_reduce_submitted_before_its_maps_sees_every_map_output(gw, session):
    maps = [new_var(gw, session, f"m{i}") for i in range(3)]
    reduce = gw.post("/v1/chat/completions", json=chat(
        "combine {{a}} | {{b}} | {{c}}",
        {"session_id": session, "wait": False, "output": "final",
         "vars": {k: {"id": v} for k, v in zip("abc", maps)}}))
    assert reduce.status_code == 202
    final = reduce.json()["parrot"]["output"]["id"]
    assert gw.get(f"/v1/vars/{final}").json()["ready"] is False
    for i, var in enumerate(maps):
        response = gw.post("/v1/chat/completions", json=chat(
            "map {{doc}}", {"session_id": session, "wait": False, "vars": {"doc": {"value": f"chunk{i}"}},
                            "output": {"id": var}}))
        assert response.status_code == 202
    result = gw.get(f"/v1/vars/{final}", params={"wait": "true", "timeout": 10, "criteria": "latency"}).json()
    assert result["ready"] and result["value"] == (
        "echo: combine echo: map chunk0 | echo: map chunk1 | echo: map chunk2")


def inline(text: str, vars: dict, **extra) -> dict:
    """A placeholder bound to an inline call: a chat request inside its consumer's."""
    return {"call": {"model": MODEL, "messages": [{"role": "user", "content": text}], "parrot": {"vars": vars}, **extra}}


def test_a_reduce_with_its_maps_inline_is_one_request(gw, session):
    """The whole graph in one round trip: the maps are inline calls of the reduce (one nested a level deeper),
    their outputs readable by the ids the answer lists."""
    answer = gw.post("/v1/chat/completions", json=chat("combine {{a}} | {{b}}", {"session_id": session, "vars": {
        "a": inline("map {{doc}}", {"doc": {"value": "chunk0"}}),
        "b": inline("map {{doc}}", {"doc": inline("title {{t}}", {"t": {"value": "x"}})})}}))

    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"] == "echo: combine echo: map chunk0 | echo: map echo: title x"
    made = answer.json()["parrot"]["inline"]
    assert set(made) == {"a", "b", "b.doc"}
    assert gw.get(f"/v1/vars/{made['a']['id']}").json()["value"] == "echo: map chunk0"
    assert gw.get(f"/v1/vars/{made['b.doc']['id']}").json()["value"] == "echo: title x"


@pytest.mark.parametrize("binding, param", [
    ({"call": {"messages": [{"role": "user", "content": "m"}]}}, "parrot.vars.b.call.model"),  # missing
    (inline("m", {}, model="no-such-model"), "parrot.vars.b.call.model"),
    (inline("m", {}, stream=True), "parrot.vars.b.call.stream"),
    (inline("m", {}, max_tokens=0), "parrot.vars.b.call.max_tokens"),
    ({"call": {"model": MODEL, "messages": [{"role": "user", "content": "m"}], "parrot": {"wait": False}}},
     "parrot.vars.b.call.parrot"),
    (inline("m {{d}}", {}), "parrot.vars.b.call.parrot.vars"),  # its own placeholder unbound
    ({**inline("m", {}), "value": "v"}, "parrot.vars.b"),
])
def test_a_bad_inline_call_is_a_4xx_naming_it_and_nothing_runs(gw, session, fake_stats, binding, param):
    """Checked as a request of its own would be; the valid inline call made before it (a) never runs, and the
    session keeps nothing."""
    before = fake_stats()["requests"]
    response = gw.post("/v1/chat/completions", json=chat("{{a}} {{b}}", {"session_id": session, "vars": {
        "a": inline("fine", {}), "b": binding}}))

    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param
    assert gw.get(f"/v1/sessions/{session}/vars").json()["data"] == []
    assert gw.get(f"/v1/sessions/{session}/graph").json()["calls"] == []
    assert fake_stats()["requests"] == before


def test_inline_calls_are_capped_per_request(gw, session):
    many = {f"v{i}": inline("m", {}) for i in range(65)}
    response = gw.post("/v1/chat/completions", json=chat(" ".join("{{" + n + "}}" for n in many),
                                                         {"session_id": session, "vars": many}))
    assert response.status_code == 400 and "max_inline_calls" in response.json()["error"]["message"]
    assert gw.get(f"/v1/sessions/{session}/vars").json()["data"] == []


def nested_chain(depth: int) -> dict:
    """A binding ``depth`` inline calls deep: each call's one placeholder is bound to the next call."""
    binding: dict = {"value": "bottom"}
    for _ in range(depth):
        binding = inline("step {{c}}", {"c": binding})
    return binding


def test_nested_inline_calls_count_as_they_are_declared(start_gateway):
    """Every level of a chain counts: nested calls are counted before their own vars are read, so a chain
    deeper than max_inline_calls is refused (once, each level saw 0 and any depth went through)."""
    url = start_gateway(semantic=SemanticConfig(max_inline_calls=3, max_inline_depth=8))
    with httpx.Client(base_url=url, timeout=20) as client:
        fits = client.post("/v1/chat/completions", json=chat("top {{c}}", {"vars": {"c": nested_chain(3)}}))
        over = client.post("/v1/chat/completions", json=chat("top {{c}}", {"vars": {"c": nested_chain(4)}}))

    assert fits.status_code == 200, fits.text
    assert fits.json()["choices"][0]["message"]["content"] == "echo: top echo: step echo: step echo: step bottom"
    assert over.status_code == 400 and "max_inline_calls" in over.json()["error"]["message"]
    assert over.json()["error"]["param"] == "parrot.vars.c.call.parrot.vars.c.call.parrot.vars.c.call.parrot.vars.c.call"


def test_inline_calls_nest_at_most_max_inline_depth(gw, session):
    """The probe's chain 100 calls deep: refused at depth 9 whatever the count allows."""
    response = gw.post("/v1/chat/completions", json=chat("top {{c}}", {"session_id": session,
                                                                      "vars": {"c": nested_chain(100)}}))

    assert response.status_code == 400 and "max_inline_depth" in response.json()["error"]["message"]
    assert response.json()["error"]["param"].count(".call") == 9
    assert gw.get(f"/v1/sessions/{session}/vars").json()["data"] == []


def test_chain_runs_server_side_in_order(gw, session):
    previous = {"value": "start"}
    for step in range(3):
        response = gw.post("/v1/chat/completions", json=chat(
            f"step{step} {{{{prev}}}}", {"session_id": session, "wait": False, "vars": {"prev": previous},
                                        "output": f"s{step}"}))
        previous = {"id": response.json()["parrot"]["output"]["id"]}
    value = gw.get(f"/v1/vars/{previous['id']}", params={"wait": "true", "timeout": 10}).json()["value"]
    assert value == "echo: step2 echo: step1 echo: step0 start"


def test_waiting_request_returns_openai_response_with_parrot_fields(gw, session):
    response = gw.post("/v1/chat/completions", json=chat(
        "hello {{name}}", {"session_id": session, "vars": {"name": {"value": "parrot"}}, "output": "greeting"}))
    body = response.json()
    assert response.status_code == 200
    assert body["choices"][0]["message"]["content"] == "echo: hello parrot"
    assert body["parrot"]["session_id"] == session and body["parrot"]["output"]["name"] == "greeting"
    stored = gw.get(f"/v1/vars/{body['parrot']['output']['id']}").json()
    assert stored["value"] == "echo: hello parrot" and stored["name"] == "greeting"


def test_streaming_request_with_variables_streams_the_bound_output(gw, session):
    body = chat("stream {{x}}", {"session_id": session, "vars": {"x": {"value": "it"}}},
                stream=True, stream_options={"include_usage": True})
    with gw.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "data: [DONE]"
    chunks = [httpx.Response(200, content=line[6:]).json() for line in lines[:-1]]
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant" and chunks[0]["parrot"]["session_id"] == session
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"]) == "echo: stream it"
    assert len([c for c in chunks if c["choices"] and c["choices"][0]["delta"].get("content")]) > 1  # as streamed
    assert chunks[-1]["usage"]["completion_tokens"] > 0


def test_completions_route_binds_prompt_placeholders(gw, session):
    response = gw.post("/v1/completions", json={"model": MODEL, "prompt": "say {{w}}",
                                                "parrot": {"session_id": session, "vars": {"w": {"value": "hi"}}}})
    assert response.json()["choices"][0]["text"] == "echo: say hi"


def test_cycle_is_rejected_with_400(gw, session):
    a, b = new_var(gw, session, "a"), new_var(gw, session, "b")
    first = gw.post("/v1/chat/completions", json=chat(
        "{{x}}", {"session_id": session, "wait": False, "vars": {"x": {"id": a}}, "output": {"id": b}}))
    assert first.status_code == 202
    second = gw.post("/v1/chat/completions", json=chat(
        "{{x}}", {"session_id": session, "wait": False, "vars": {"x": {"id": b}}, "output": {"id": a}}))
    assert second.status_code == 400
    assert second.json()["error"]["code"] == "cycle"


def test_self_loop_is_a_cycle(gw, session):
    a = new_var(gw, session, "a")
    response = gw.post("/v1/chat/completions", json=chat(
        "{{x}}", {"session_id": session, "wait": False, "vars": {"x": {"id": a}}, "output": {"id": a}}))
    assert response.status_code == 400 and response.json()["error"]["code"] == "cycle"


def test_never_produced_variable_times_out_clearly(gw, session):
    orphan = new_var(gw, session, "orphan")
    response = gw.get(f"/v1/vars/{orphan}", params={"wait": "true", "timeout": 0.3})
    assert response.status_code == 504
    error = response.json()["error"]
    assert error["code"] == "variable_timeout" and "nothing produces it" in error["message"]


def test_consumer_of_never_produced_variable_fails_after_input_timeout(start_gateway):
    from gateway.config import SemanticConfig

    url = start_gateway(semantic=SemanticConfig(input_timeout_s=0.3))
    with httpx.Client(base_url=url, timeout=10) as gw:
        orphan = gw.post("/v1/vars", json={"name": "orphan"}).json()["id"]
        response = gw.post("/v1/chat/completions", json=chat("use {{x}}", {"vars": {"x": {"id": orphan}}}))
    assert response.status_code == 504
    assert "'orphan'" in response.json()["error"]["message"]


def test_failing_producer_fails_its_consumer_naming_it(gw, session):
    producer = gw.post("/v1/chat/completions", json=chat(
        "boom", {"session_id": session, "wait": False, "output": "bad"}, fake={"status": 500}))
    bad = producer.json()["parrot"]
    consumer = gw.post("/v1/chat/completions", json=chat(
        "use {{x}}", {"session_id": session, "vars": {"x": {"id": bad["output"]["id"]}}}))
    assert consumer.status_code == 424
    message = consumer.json()["error"]["message"]
    assert bad["call_id"] in message and "'bad'" in message and "fake upstream error" in message
    failed = gw.get(f"/v1/vars/{bad['output']['id']}").json()
    assert failed["ready"] and failed["value"] is None and "fake upstream error" in failed["error"]


def test_an_engine_answering_200_with_something_else_is_a_502(http, serve, start_gateway):
    async def html_upstream(scope, receive, send):
        if scope["type"] != "http":
            return
        await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/html")]})
        await send({"type": "http.response.body", "body": b"<html>a proxy's error page</html>"})

    url = start_gateway([UpstreamConfig(model=MODEL, base_url=f"{serve(html_upstream)}/v1")])

    response = http.post(f"{url}/v1/chat/completions", json=chat("hi", {}))

    assert response.status_code == 502, response.text
    assert "not an OpenAI chat/completions response" in response.json()["error"]["message"]


def test_sessions_and_variables_are_private_to_their_api_key(start_gateway):
    from gateway.config import AuthConfig

    url = start_gateway(auth=AuthConfig(api_keys=["key-a", "key-b"]))
    alice = httpx.Client(base_url=url, headers={"authorization": "Bearer key-a"})
    bob = httpx.Client(base_url=url, headers={"authorization": "Bearer key-b"})
    session = alice.post("/v1/sessions").json()["id"]
    var = alice.post("/v1/vars", json={"session_id": session, "value": "secret"}).json()["id"]
    assert alice.get(f"/v1/vars/{var}").json()["value"] == "secret"
    assert bob.get(f"/v1/vars/{var}").status_code == 404
    assert bob.get(f"/v1/sessions/{session}/vars").status_code == 404
    assert bob.delete(f"/v1/sessions/{session}").status_code == 404
    assert bob.post("/v1/chat/completions", json=chat("x", {"session_id": session})).status_code == 404
    assert bob.post("/v1/vars", json={"session_id": session}).status_code == 404
    assert alice.delete(f"/v1/sessions/{session}").status_code == 200
    assert alice.get(f"/v1/vars/{var}").status_code == 404


def test_deleting_a_session_forgets_its_variables(gw):
    session = gw.post("/v1/sessions").json()["id"]
    var = new_var(gw, session, "v", "1")
    listed = gw.get(f"/v1/sessions/{session}/vars").json()["data"]
    assert [v["id"] for v in listed] == [var]
    deleted = gw.delete(f"/v1/sessions/{session}").json()
    assert deleted["deleted"] and deleted["freed_variables"] == 1
    assert gw.get(f"/v1/vars/{var}").status_code == 404
    assert gw.get(f"/v1/sessions/{session}/vars").status_code == 404


def test_put_sets_a_variable_once_and_wakes_its_consumers(gw, session):
    var = new_var(gw, session, "later")
    consumer = gw.post("/v1/chat/completions", json=chat(
        "got {{x}}", {"session_id": session, "wait": False, "vars": {"x": {"id": var}}}))
    out = consumer.json()["parrot"]["output"]["id"]
    assert gw.put(f"/v1/vars/{var}", json={"value": "now"}).status_code == 200
    assert gw.put(f"/v1/vars/{var}", json={"value": "again"}).status_code == 409
    assert gw.get(f"/v1/vars/{out}", params={"wait": "true", "timeout": 10}).json()["value"] == "echo: got now"


@pytest.mark.parametrize("parrot, param", [
    ({"vars": {}}, "parrot.vars"),  # {{x}} unbound
    ({"vars": {"x": {"id": "var_nope"}}}, None),  # unknown variable: 404
    ({"vars": {"x": {"value": "a", "id": "b"}}}, "parrot.vars.x"),
    ({"vars": {"x": {"value": "a"}}, "criteria": "fast"}, "parrot"),
    ({"vars": {"x": {"value": "a"}}, "session_id": "sess_unknown"}, "session_id"),
    ({"vars": {"x": {"value": "a"}}, "output": {"name": "n", "id": "var_x"}}, "parrot.output"),
])
def test_bad_extension_is_a_4xx_naming_the_field(gw, parrot, param):
    response = gw.post("/v1/chat/completions", json=chat("{{x}}", parrot))
    assert 400 <= response.status_code < 500, response.text
    assert response.json()["error"]["param"] == param


def test_semantic_call_generates_outputs_in_order(gw, session):
    response = gw.post("/v1/semantic_calls", json={
        "model": MODEL, "session_id": session,
        "template": "Topic: {{input:topic}}. First: {{output:first}} Then: {{output:second}}",
        "inputs": {"topic": {"value": "birds"}}, "outputs": {"first": {"max_tokens": 8}}})
    assert response.status_code == 202
    outputs = response.json()["outputs"]
    first = gw.get(f"/v1/vars/{outputs['first']['id']}", params={"wait": "true", "timeout": 10}).json()["value"]
    second = gw.get(f"/v1/vars/{outputs['second']['id']}", params={"wait": "true", "timeout": 10}).json()["value"]
    # the fake echoes the prompt: the second output's prompt held the first output
    assert first == "echo: Topic: birds. First: "
    assert second == f"echo: Topic: birds. First: {first} Then: "


def test_a_stream_cannot_be_queued(gw, session):
    response = gw.post("/v1/chat/completions", json=chat(
        "{{x}}", {"session_id": session, "wait": False, "vars": {"x": {"value": "a"}}}, stream=True))
    assert response.status_code == 400 and response.json()["error"]["param"] == "parrot.wait"
    assert gw.get(f"/v1/sessions/{session}/vars").json()["data"] == []  # nothing was queued


@pytest.mark.parametrize("outputs, param", [
    ({"o": {"max_token": 3}}, None),  # a misspelt field is not silently ignored
    # ranges are checked as the body is decoded (one sampling schema): msgspec names a map's key "[...]"
    ({"o": {"max_tokens": -3}}, "outputs[...].max_tokens"),
    ({"o": {"temperature": -1}}, "outputs[...].temperature"),
    ({"o": {"max_tokens": 0}}, "outputs.o.max_tokens"),
    ({"o": {"logit_bias": {"x": 1}}}, "outputs.o.logit_bias"),
    ({"p": {"max_tokens": 3}}, "outputs.p"),  # no {{output:p}} in the template
])
def test_semantic_call_sampling_is_checked_before_it_is_accepted(gw, session, outputs, param):
    response = gw.post("/v1/semantic_calls", json={
        "model": MODEL, "session_id": session, "template": "Say {{output:o}}", "outputs": outputs})
    assert response.status_code == 400, response.text
    if param is not None:
        assert response.json()["error"]["param"] == param
    assert gw.get(f"/v1/sessions/{session}/vars").json()["data"] == []


def test_reading_a_ready_variable_without_waiting_time_answers_its_value(gw, session):
    var = new_var(gw, session, "lit", "ready")
    response = gw.get(f"/v1/vars/{var}", params={"wait": "true", "timeout": 0})
    assert response.status_code == 200 and response.json()["value"] == "ready"


def test_a_request_the_engine_rejects_leaves_no_variables_behind(gw, session):
    response = gw.post("/v1/chat/completions", json=chat(
        "{{a}}", {"session_id": session, "vars": {"a": {"value": "x"}}, "output": "o"}, fake={"status": 400}))
    assert response.status_code == 400, response.text
    assert gw.get(f"/v1/sessions/{session}/vars").json()["data"] == []


def test_semantic_call_without_output_is_400(gw):
    response = gw.post("/v1/semantic_calls", json={"model": MODEL, "template": "no outputs {{input:x}}",
                                                   "inputs": {"x": {"value": "1"}}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "template"


def test_inline_calls_are_the_extensions_only(gw):
    """A semantic call's inputs bind variables and values; inline calls belong to the OpenAI extension."""
    response = gw.post("/v1/semantic_calls", json={"model": MODEL, "template": "{{input:x}} {{output:y}}",
                                                   "inputs": {"x": inline("m", {})}})
    assert response.status_code == 400 and response.json()["error"]["param"] == "inputs.x"


# ---------------------------------------------------------------- performance deduction (graph level)


class _Runner:
    """Runs calls with ``work(call, values)`` (graph.CallRunner), nothing ahead."""

    def __init__(self, work):
        self.work = work

    async def warm(self, call):
        pass

    async def run_ahead(self, call):
        return None

    async def run(self, call, values):
        return await self.work(call, values)


async def _empty_outputs(call, values):
    await asyncio.sleep(0)
    return {name: "" for name in call.outputs}


_idle = _Runner(_empty_outputs)
NOTHING = CallSpec(())


async def test_latency_read_makes_transitive_producers_latency_critical():
    session = Session("owner", {})
    doc = session.new_variable("doc", "text")
    maps = [session.new_variable(f"m{i}") for i in range(2)]
    final = session.new_variable("final")
    blocker = session.new_variable("blocker")  # never set: keeps every call waiting
    producers = [Call(session, {"d": doc, "b": blocker}, {"o": m}, NOTHING, _idle, latency=False) for m in maps]
    reducer = Call(session, {"a": maps[0], "b": maps[1]}, {"o": final}, NOTHING, _idle, latency=False)
    for call in [*producers, reducer]:
        session.add_call(call, input_timeout_s=5)
    assert not any(c.latency for c in [*producers, reducer])
    final.producer.mark_latency()
    assert all(c.latency for c in [*producers, reducer])
    assert reducer.priority > Call(Session("x", {}), {}, {}, NOTHING, _idle, latency=False).priority
    assert Call.group_peers(producers[0].consumers()) == set(producers)  # they feed the same consumer
    session.close()


async def test_a_producer_linked_after_its_urgent_consumer_is_urgent_too():
    session = Session("owner", {})
    summary, final = session.new_variable("summary"), session.new_variable("final")
    reducer = Call(session, {"s": summary}, {"o": final}, NOTHING, _idle, latency=True)
    session.add_call(reducer, input_timeout_s=5)
    mapper = Call(session, {}, {"o": summary}, NOTHING, _idle, latency=False)
    session.add_call(mapper, input_timeout_s=5)
    assert mapper.latency
    session.close()


async def test_engine_hints_batch_a_task_group_even_when_urgent():
    session = Session("owner", {})
    summaries = [session.new_variable(f"s{i}") for i in range(2)]
    seen: dict[str, dict] = {}
    maps_running = asyncio.Event()

    async def record(call, values):
        seen[call.id] = call.engine_hints()
        if all(m.id in seen for m in mappers):
            maps_running.set()
        await maps_running.wait()  # the maps run at the same time, as on an engine
        return {name: "" for name in call.outputs}

    reducer = Call(session, {f"s{i}": v for i, v in enumerate(summaries)}, {"o": session.new_variable()},
                   NOTHING, _Runner(record), latency=True)
    session.add_call(reducer, input_timeout_s=5)
    mappers = [Call(session, {}, {"o": v}, NOTHING, _Runner(record), latency=False) for v in summaries]
    alone = Call(session, {}, {"o": session.new_variable()}, NOTHING, _Runner(record), latency=True)
    for call in [*mappers, alone]:
        session.add_call(call, input_timeout_s=5)
    await reducer.task
    await alone.task
    # The reduce waits for both maps: they run as one throughput batch, at latency priority. The
    # call nothing else waits with is latency-critical, as a map would be that runs last, alone.
    assert [seen[m.id]["criteria"] for m in mappers] == ["throughput", "throughput"]
    assert all(seen[m.id]["priority"] >= LATENCY_PRIORITY - session.arrival for m in mappers)
    assert seen[reducer.id]["criteria"] == seen[alone.id]["criteria"] == "latency"
    session.close()


async def test_a_sole_producer_of_an_urgent_consumer_is_not_a_task_group():
    session = Session("owner", {})
    question, answer = session.new_variable("question"), session.new_variable("answer")
    seen: dict[str, dict] = {}

    async def record(call, values):
        seen[call.id] = call.engine_hints()
        return {name: "" for name in call.outputs}

    # One call with two outputs that one urgent consumer reads: nobody else feeds that consumer.
    reader = Call(session, {"q": question, "a": answer}, {"o": session.new_variable()}, NOTHING, _Runner(record),
                  latency=True)
    session.add_call(reader, input_timeout_s=5)
    writer = Call(session, {}, {"q": question, "a": answer}, NOTHING, _Runner(record), latency=False)
    session.add_call(writer, input_timeout_s=5)
    await reader.task
    assert seen[writer.id]["criteria"] == "latency"
    session.close()


async def test_app_fifo_earlier_sessions_go_first():
    older, newer = Session("o", {}), Session("o", {})
    first_stage_new = Call(newer, {}, {}, NOTHING, _idle, latency=False)
    later_stage_old = Call(older, {}, {}, NOTHING, _idle, latency=False)
    assert later_stage_old.priority > first_stage_new.priority


def test_put_error_fails_the_variable_and_its_consumers(gw, session):
    var = new_var(gw, session, "client_side")
    consumer = gw.post("/v1/chat/completions", json=chat(
        "got {{x}}", {"session_id": session, "wait": False, "vars": {"x": {"id": var}}})).json()["parrot"]
    assert gw.put(f"/v1/vars/{var}", json={"error": "parser crashed"}).status_code == 200
    out = gw.get(f"/v1/vars/{consumer['output']['id']}", params={"wait": "true", "timeout": 10}).json()
    assert "parser crashed" in out["error"] and out["value"] is None
    assert gw.put(f"/v1/vars/{var}", json={}).status_code == 409  # already failed
    fresh = new_var(gw, session)
    assert gw.put(f"/v1/vars/{fresh}", json={}).status_code == 400


# ---------------------------------------------------------------- sessions deleted under running work


def test_deleting_a_session_under_a_waiting_request_answers_409(gw, fake_stats):
    session = gw.post("/v1/sessions").json()["id"]
    seen = fake_stats()["requests"]

    def delete_soon():
        wait_until(lambda: fake_stats()["requests"] > seen)  # the request is waiting on the engine
        gw.delete(f"/v1/sessions/{session}")

    deleter = threading.Thread(target=delete_soon)
    deleter.start()
    response = gw.post("/v1/chat/completions", json=chat("slow", {"session_id": session}, fake={"delay_s": 3}))
    deleter.join()

    assert response.status_code == 409, response.text
    assert response.json()["error"]["code"] == "session_deleted"


def test_deleting_a_session_wakes_its_waiting_readers_with_404(gw):
    session = gw.post("/v1/sessions").json()["id"]
    var = new_var(gw, session, "never")
    deleted = []
    deleter = threading.Timer(0.5, lambda: deleted.append(gw.delete(f"/v1/sessions/{session}").status_code))
    deleter.start()

    started = time.monotonic()
    response = gw.get(f"/v1/vars/{var}", params={"wait": "true", "timeout": 30})
    deleter.join()  # before the client closes

    assert response.status_code == 404 and time.monotonic() - started < 10
    assert deleted == [200]


def test_a_rejected_request_leaves_no_variables_behind(gw, session):
    for _ in range(3):
        response = gw.post("/v1/chat/completions", json=chat(
            "{{a}}", {"session_id": session, "vars": {"a": {"value": "x"}}, "output": {"id": "var_bogus"}}))
        assert response.status_code == 404

    assert gw.get(f"/v1/sessions/{session}/vars").json()["data"] == []


def test_streamed_parrot_answers_keep_tool_calls_and_completion_objects(gw, session):
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    chat_events = gw.post("/v1/chat/completions", json=chat(
        "hi {{x}}", {"session_id": session, "vars": {"x": {"value": "bob"}}}, stream=True, tools=tools)).text
    completion_events = gw.post("/v1/completions", json={
        "model": MODEL, "prompt": "hi {{x}}", "stream": True, "stream_options": {"include_usage": True},
        "parrot": {"session_id": session, "vars": {"x": {"value": "bob"}}}}).text

    first = json.loads(chat_events.split("\n\n")[0].removeprefix("data: "))
    assert first["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "f"
    assert first["choices"][0]["delta"]["tool_calls"][0]["index"] == 0
    chunks = [json.loads(e.removeprefix("data: ")) for e in completion_events.split("\n\n") if e.startswith("data: {")]
    assert {c["object"] for c in chunks} == {"text_completion"} and chunks[-1]["usage"]


@pytest.mark.slow  # thousands of calls
async def test_latency_marking_walks_chains_thousands_deep():
    session = Session("owner", {})
    previous = session.new_variable("blocker")  # never set: the chain waits
    for _ in range(3000):
        output = session.new_variable()
        session.add_call(Call(session, {"in": previous}, {"out": output}, NOTHING, _idle, latency=False),
                         input_timeout_s=5)
        previous = output

    session.add_call(Call(session, {"in": previous}, {"out": session.new_variable()}, NOTHING, _idle, latency=True),
                     input_timeout_s=5)

    assert all(call.latency for call in session.calls.values())
    session.close()


async def test_a_default_session_forgets_its_oldest_finished_variables_only():
    index: dict = {}
    session = Session("owner", index, default=True, max_variables=10)
    pending = session.new_variable("pending")  # an input nobody has produced yet: kept
    session.add_call(Call(session, {"in": pending}, {"out": session.new_variable("out")}, NOTHING, _idle,
                          latency=False), input_timeout_s=5)
    finished = [session.new_variable(f"v{i}", "value") for i in range(20)]

    assert len(session.variables) <= 10 and pending.id in session.variables
    assert finished[-1].id in session.variables and finished[0].id not in session.variables
    assert index.keys() == session.variables.keys()
    session.close()


async def test_a_failure_carried_down_a_long_chain_stays_short():
    session = Session("owner", {})
    first = session.new_variable("first")
    previous = first
    for _ in range(300):
        output = session.new_variable()
        session.add_call(Call(session, {"in": previous}, {"out": output}, NOTHING, _idle, latency=False),
                         input_timeout_s=5)
        previous = output
    first.fail("the original reason")

    with pytest.raises(VariableFailed) as failed:
        await previous.get(timeout_s=10)

    assert len(str(failed.value)) < 3000 and "the original reason" in str(failed.value)
    session.close()
