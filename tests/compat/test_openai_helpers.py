"""compat.openai against a real gateway in front of the fake upstream (which echoes the last user message)."""

from __future__ import annotations

import openai
import pytest

from compat.openai import (
    Session,
    Variable,
    VariableError,
    VariableTimeout,
    inline_call,
    output_variable,
    parrot_extra,
    referenced_variables,
)
from tests.support.fake_upstream import MODEL  # what the gateway fixtures serve


def user(text: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": text}]


def test_parrot_extra_shapes_the_extension(client):
    variable = Variable(client, "var_abc")

    extra = parrot_extra(vars={"a": variable, "b": "text", "c": {"id": "var_c"}}, output="out",
                         session="sess_1", criteria="throughput", wait=False)

    assert extra == {"parrot": {"session_id": "sess_1", "output": "out", "criteria": "throughput", "wait": False,
                                "vars": {"a": {"id": "var_abc"}, "b": {"value": "text"}, "c": {"id": "var_c"}}}}
    assert parrot_extra() == {"parrot": {}}
    assert parrot_extra(output=variable)["parrot"]["output"] == {"id": "var_abc"}
    with pytest.raises(TypeError):
        parrot_extra(vars={"a": 3})


def test_a_formatted_variable_is_a_placeholder_that_binds_itself(client):
    variable = Variable(client, "var_x-1_y")

    request = {"messages": [{"role": "system", "content": f"ctx {variable}"},
                            {"role": "user", "content": [{"type": "text", "text": "{{ var_q }}"}]}]}

    assert str(variable) == "{{var_x-1_y}}"
    assert referenced_variables(request) == {"var_x-1_y": {"id": "var_x-1_y"}, "var_q": {"id": "var_q"}}
    assert referenced_variables({"prompt": ["a {{var_p}}", "{{not_a_var}}"]}) == {"var_p": {"id": "var_p"}}


def test_extension_on_a_plain_sdk_call_and_its_output_variable(client):
    reply = client.chat.completions.create(model=MODEL, messages=user("say {{word}}"),
                                           extra_body=parrot_extra(vars={"word": "hi"}, output="said"))

    assert reply.choices[0].message.content == "echo: say hi"
    said = output_variable(client, reply)
    assert said.name == "said"
    assert said.get() == "echo: say hi"


def test_a_reduce_with_inline_maps_is_one_sdk_call(client):
    maps = {k: inline_call(model=MODEL, messages=user("map {{doc}}"), max_tokens=8, vars={"doc": doc})
            for k, doc in (("a", "x"), ("b", "y"))}

    reply = client.chat.completions.create(model=MODEL, messages=user("combine {{a}} {{b}}"),
                                           extra_body=parrot_extra(vars=maps))

    assert reply.choices[0].message.content == "echo: combine echo: map x echo: map y"
    made = reply.model_extra["parrot"]["inline"]
    assert Variable(client, made["b"]["id"]).get() == "echo: map y"


def test_submitted_dag_runs_only_when_its_input_is_set(client):
    with Session(client) as session:
        gate = session.variable("gate")
        first = session.submit(client.chat.completions, model=MODEL, messages=user(f"one {gate}"), output="first")
        second = session.submit(client.chat.completions.create, model=MODEL, messages=user(f"two {first}"),
                                output="second")
        # Both handles exist; nothing can have run because the root input has no value yet.
        assert not first.ready and not second.ready
        assert {v["name"]: v["ready"] for v in session.variables()} == {"gate": False, "first": False,
                                                                       "second": False}

        gate.set("go")

        assert second.get(timeout=10) == "echo: two echo: one go"
        assert first.get() == "echo: one go"
        assert first.session_id == second.session_id == session.id


def test_submit_into_an_existing_variable_and_on_completions(client):
    with Session(client) as session:
        target = session.variable("target")
        produced = session.submit(client.completions, model=MODEL, prompt="{{x}}!", vars={"x": "hey"},
                                  output=target)

        assert produced == target
        assert target.get(timeout=10) == "echo: hey!"


def test_wait_times_out_on_a_variable_nobody_produces(client):
    with Session(client) as session:
        orphan = session.variable("orphan")

        with pytest.raises(VariableTimeout):
            orphan.get(timeout=0.2)
        assert orphan.ready is False


def test_a_failed_producer_fails_its_variable(client):
    with Session(client) as session:
        failing = session.submit(client.chat.completions, model=MODEL, messages=user("x"),
                                 extra_body={"fake": {"status": 400}})
        downstream = session.submit(client.chat.completions, model=MODEL, messages=user(f"after {failing}"))

        with pytest.raises(VariableError, match="fake upstream error"):
            failing.get(timeout=10)
        with pytest.raises(VariableError):
            downstream.get(timeout=10)


def test_setting_a_produced_variable_is_a_conflict(client):
    with Session(client) as session:
        produced = session.submit(client.chat.completions, model=MODEL, messages=user("x"))

        with pytest.raises(openai.ConflictError):
            produced.set("mine")


def test_closing_a_session_frees_its_variables(client):
    session = Session(client).open()
    kept = session.variable("kept", value="v")
    assert kept.get() == "v"

    deleted = session.close()

    assert deleted["freed_variables"] == 1
    with pytest.raises(openai.NotFoundError):
        kept.read()
    with pytest.raises(RuntimeError, match="not created"):
        Session(client).variable()


def test_sync_methods_refuse_an_async_client(async_client):
    with pytest.raises(TypeError, match="aget"):
        Variable(async_client, "var_x").get()


async def test_async_session_submit_and_aget(async_client):
    async with Session(async_client) as session:
        gate = await session.avariable("gate")
        left = await session.asubmit(async_client.chat.completions, model=MODEL, messages=user(f"L {gate}"))
        right = await session.asubmit(async_client.chat.completions, model=MODEL, messages=user(f"R {gate}"))
        both = await session.asubmit(async_client.chat.completions, model=MODEL,
                                     messages=user(f"{left} + {right}"), output="both")
        assert not await both.aready()

        await gate.aset("g")

        assert await both.aget(timeout=10) == "echo: echo: L g + echo: R g"
        assert len(await session.avariables()) == 4


async def test_async_helpers_accept_a_sync_client(client):
    session = await Session(client).aopen()
    try:
        variable = await session.avariable(value="ready")
        assert await variable.aget() == "ready"
        outputs = await session.asemantic_call(MODEL, "A {{input:v}} {{output:o}}", inputs={"v": variable})
        assert await outputs["o"].aget(timeout=10) == "echo: A ready "
    finally:
        await session.aclose()
