"""The engine's side of the handoff: a fork whose text names an earlier generation's output waits on the
engine, then runs after that output's text, tokenized with the text around it as one text, in the step
after it was produced. Real engine (the default model) over HTTP on loopback."""

from __future__ import annotations

import asyncio
import os
import re

import httpx
from tests.support import plain_http
import pytest

from engines.builtin.serving.errors import InputUnavailable
from engines.builtin.serving.named_outputs import NamedOutputs, Output
from engines.builtin.splicing import SEAM_TOKENS
from engines.builtin.tokenizer import text_tokens

pytestmark = pytest.mark.timeout(120)
# No space at its end: a fork's text then meets it at a pre-token boundary, which keeps the context's tokens.
SYSTEM = ("You are a concise assistant. Answer in one short sentence, without preamble. " * 2).rstrip()
GREEDY = {"temperature": 0, "max_tokens": 12}


@pytest.fixture(scope="module")
def context(base_url):
    with httpx.Client(base_url=base_url, timeout=60) as http:
        context_id = http.post("/v1/contexts", json={"text": SYSTEM}).json()["context_id"]
        yield context_id
        http.delete(f"/v1/contexts/{context_id}")


def handoff_waits(http: httpx.Client) -> dict[str, float]:
    """The engine's ``parrot:handoff_wait_steps`` histogram: bucket bounds (and count) -> observations."""
    text = http.get("/metrics").text
    buckets = {le: float(v) for le, v in re.findall(r'parrot:handoff_wait_steps_bucket\{le="([^"]+)".*\} (\S+)', text)}
    count = re.search(r"parrot:handoff_wait_steps_count\{.*\} (\S+)", text)
    return buckets | {"count": float(count.group(1)) if count else 0.0}


def fork(text_or_parts, **extra) -> dict:
    body = {**GREEDY, "fork": True, **extra}
    body["text" if isinstance(text_or_parts, str) else "parts"] = text_or_parts
    return body


@pytest.mark.parametrize("with_context_text", [False, True], ids=["fork-text-alone", "context-text-given"])
async def test_a_consumer_sent_first_runs_on_its_prompt_as_one_text_in_the_next_step(smollm2_core, base_url, context,
                                                                                      with_context_text):
    output_id = f"out-{os.urandom(6).hex()}"
    lead, question = "\nEarlier, the assistant gave this short answer:", "Q: Name one primary color.\nA:"
    follow_up = "\nQ: Repeat the answer above in capitals.\nA:"
    given = {"context_text": SYSTEM} if with_context_text else {}
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        before = handoff_waits(httpx.Client(base_url=base_url))
        stats = (await http.get("/v1/stats")).json()
        consumer = asyncio.ensure_future(http.post(f"/v1/contexts/{context}/generate", json=fork([
            {"text": lead}, {"output_of": output_id}, {"text": follow_up}], **given)))
        # The consumer waits on the engine (nothing produces its input yet), its text before the input
        # computed meanwhile, less the tokens that may merge with the input.
        ahead = len(text_tokens(smollm2_core.tokenizer, lead)) - SEAM_TOKENS
        for _ in range(100):
            now = (await http.get("/v1/stats")).json()
            if now["prompt_tokens"] - stats["prompt_tokens"] == ahead and now["running"] == now["waiting"] == 0:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail(f"the consumer's leading text was not computed ahead: {stats} -> {now}")
        assert not consumer.done()
        produced = (await http.post(f"/v1/contexts/{context}/generate",
                                    json=fork(question, output_id=output_id))).json()
        handed = (await consumer).json()
        # The rule: the producer's text in its place, tokenized as one text with the context's text when
        # it is given (the prompt a plain request sends), else with the fork's own text alone.
        prompt = (SYSTEM if with_context_text else "") + lead + produced["text"] + follow_up
        if with_context_text:
            model = (await http.get("/v1/models")).json()["data"][0]["id"]
            alike = (await http.post("/v1/completions", json={**GREEDY, "model": model, "prompt": prompt})
                     ).json()["choices"][0]
        else:
            alike = (await http.post(f"/v1/contexts/{context}/generate", json={**GREEDY, "fork": True, "tokens":
                                     text_tokens(smollm2_core.tokenizer, prompt)})).json()
    counted = handed["usage"]["prompt_tokens"] + (handed["context_tokens"] if with_context_text else 0)
    assert counted == len(text_tokens(smollm2_core.tokenizer, prompt))
    assert handed["text"] == alike["text"]
    assert handed["usage"]["prompt_tokens_details"]["cached_tokens"] >= ahead  # computed ahead, not again
    after = handoff_waits(httpx.Client(base_url=base_url))
    assert plain_http.get(f"{base_url}/v1/stats").json()["blocks_free"] == stats["blocks_free"]  # the ahead context freed
    assert after["count"] == before["count"] + 1
    assert after["1.0"] == before.get("1.0", 0) + 1  # its first token came in the step after the producer's last


async def test_an_output_cut_by_a_stop_string_is_handed_over_as_its_text(smollm2_core, base_url, context):
    output_id = f"out-{os.urandom(6).hex()}"
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        produced = (await http.post(f"/v1/contexts/{context}/generate", json=fork(
            "Q: Count from one to five in words.\nA:", output_id=output_id, stop=["thr"], max_tokens=20))).json()
        handed = (await http.post(f"/v1/contexts/{context}/generate", json=fork(
            [{"output_of": output_id}, {"text": "\nAgain:"}]))).json()
    assert produced["finish_reason"] == "stop" and "thr" not in produced["text"]
    expected = text_tokens(smollm2_core.tokenizer, produced["text"] + "\nAgain:")
    assert handed["usage"]["prompt_tokens"] == len(expected)


async def test_consumers_of_a_failed_producer_get_a_424_and_names_are_not_reused(base_url, context):
    output_id = f"out-{os.urandom(6).hex()}"
    async with httpx.AsyncClient(base_url=base_url, timeout=60) as http:
        consumer = asyncio.ensure_future(http.post(f"/v1/contexts/{context}/generate",
                                                   json=fork([{"output_of": output_id}], stream=True)))
        await asyncio.sleep(0.2)
        failed = await http.post("/v1/contexts/no-such-context/generate", json=fork("Hi", output_id=output_id))
        assert failed.status_code == 404
        refused = await consumer
        assert refused.status_code == 424 and refused.json()["error"]["code"] == "input_unavailable"
        again = await http.post(f"/v1/contexts/{context}/generate", json=fork("Hi", output_id=output_id))
        assert again.status_code == 409 and again.json()["error"]["code"] == "output_id_taken"


@pytest.mark.parametrize("body, param", [
    (fork([{"text": "a", "output_of": "x"}]), "parts.0"),
    (fork([{}]), "parts.0"),
    ({**GREEDY, "parts": [{"text": "a"}]}, "fork"),
    (fork("a") | {"parts": [{"text": "a"}]}, "parts"),
    (fork([{"output_of": "me"}], output_id="me"), "parts.0"),
])
def test_bad_parts_are_400s(base_url, context, body, param):
    with httpx.Client(base_url=base_url, timeout=30) as http:
        response = http.post(f"/v1/contexts/{context}/generate", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text


async def test_a_consumer_of_an_output_nobody_starts_producing_is_refused_in_time():
    """Its producer never reached this engine (refused before it began, or sent elsewhere): the wait ends."""
    outputs = NamedOutputs(unclaimed_wait_s=0.1)
    with pytest.raises(InputUnavailable, match="no generation started"):
        await outputs.wait("never")
    outputs.begin("slow")  # one being produced is waited for however long it takes
    waiter = asyncio.ensure_future(outputs.wait("slow"))
    await asyncio.sleep(0.3)
    assert not waiter.done()
    outputs.produce("slow", Output("one two", step=7))
    assert await waiter == Output("one two", 7)
    assert len(outputs) == 1  # the unclaimed one was forgotten with its last waiter
