"""Same answers with or without Parrot: every app run through the ``parrot`` extension (or the native API)
gives, byte for byte, the outputs and prompt token counts of the same app run client-side with plain
requests, greedy, on the real default model. On the builtin engine (forks, shared prefixes, the handoff
between producers and consumers) and through an upstream engine without contexts (plain substitution):
the prompt of a semantic call is exactly what a plain request would send."""

from __future__ import annotations

import asyncio
import json
import os
from typing import Any, Iterator

import httpx
import pytest

from benchmarks.workloads import chain, map_reduce, multi_agent, shared_prompt
from benchmarks.workloads.text import document
from gateway.server.app import create_app
from gateway.config import BuiltinConfig, GatewayConfig, SemanticConfig, UpstreamConfig
from tests.support.models import SMOLLM
from tests.support import plain_http

# Every test here loads a model in an engine process (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.timeout(600), pytest.mark.model, pytest.mark.subprocess]
ENGINE_KEY_ENV = "PARROT_FIDELITY_ENGINE_KEY"
GREEDY = {"temperature": 0, "max_tokens": 24}
# Small sizes of each app, ending at EOS as real apps do (not ignore_eos).
APPS = {
    "map_reduce": (map_reduce, map_reduce.Config(chunks=4, chunk_words=40, map_tokens=16, reduce_tokens=24,
                                                 ignore_eos=False)),
    "chain": (chain, chain.Config(chunks=3, chunk_words=40, step_tokens=20, ignore_eos=False)),
    "multi_agent": (multi_agent, multi_agent.Config(coders=2, plan_tokens=20, code_tokens=16, review_tokens=16,
                                                    ignore_eos=False)),
    "shared_prompt": (shared_prompt, shared_prompt.Config(users=3, system_words=80, answer_tokens=16,
                                                          ignore_eos=False)),
}


@pytest.fixture(scope="module")
def gateways(smollm_gateway, serve_module) -> Iterator[dict[str, str]]:
    """The builtin engine behind the gateway it registered with, and the same engine as a plain OpenAI
    upstream of a second gateway (no context capability: values substituted into the request) that prefills
    waiting calls there ahead of their inputs (``prefill_ahead``, gateway/semantic/prefill.py), extending the
    prefill as their producers stream. Its answers equal the plain requests' with the prefills, so without them
    too: a prefill only warms the engine's cache (one gateway for both keeps this module's time down)."""
    os.environ[ENGINE_KEY_ENV] = smollm_gateway["secret"]

    upstream = serve_module(create_app(GatewayConfig(
        builtin=BuiltinConfig(enabled=False), semantic=SemanticConfig(prefill_extend_chars=48),
        upstreams=[UpstreamConfig(model=SMOLLM, base_url=f"{smollm_gateway['engine']}/v1",
                                  api_key_env=ENGINE_KEY_ENV, prefill_ahead=True)])))
    yield {"builtin": smollm_gateway["gateway"], "upstream": upstream}
    os.environ.pop(ENGINE_KEY_ENV, None)


@pytest.fixture(params=["builtin", "upstream"])
def gateway(request, gateways) -> str:
    return gateways[request.param]


def run(app, gateway: str, mode: str, cfg) -> Any:
    async def go():
        async with httpx.AsyncClient(base_url=f"{gateway}/v1", timeout=300) as client:
            return await getattr(app, f"run_{mode}")(client, SMOLLM, cfg)

    return asyncio.run(go())


@pytest.mark.parametrize("name", APPS)
def test_an_app_answers_the_same_through_the_extension_as_with_plain_requests(gateways, name):
    """On the builtin engine, where forks and the handoff make the prompts; through an upstream the extension only
    substitutes text, which the issue's map-reduce, the stream and the native call below check there too."""
    gateway = gateways["builtin"]
    app, cfg = APPS[name]
    plain = run(app, gateway, "baseline", cfg)
    through_parrot = run(app, gateway, "parrot", cfg)
    assert through_parrot.parts == plain.parts
    assert through_parrot.output == plain.output
    if name == "shared_prompt":  # every answer has usage; they arrive in any order
        assert sorted(through_parrot.prompt_tokens) == sorted(plain.prompt_tokens)
    else:  # the final call's
        assert through_parrot.prompt_tokens[-1] == plain.prompt_tokens[-1]


def prefills(gateway: str) -> float:
    """The gateway's parrot:prefill_ahead_total, all engines together."""
    text = plain_http.get(f"{gateway}/metrics").text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("parrot:prefill_ahead_total"))


@pytest.mark.parametrize("name", ["chain", "map_reduce"])
def test_an_app_prefilled_ahead_on_an_upstream_answers_as_with_plain_requests(gateways, name):
    """Through an upstream that takes prefill-only requests, each waiting call's prompt up to its pending input
    (a chain step's summary so far, the reduce's notes) is computed on the engine ahead and then hit: the
    outputs and the final prompt's token count are still the plain app's."""
    gateway = gateways["upstream"]
    app, cfg = APPS[name]
    plain = run(app, gateway, "baseline", cfg)
    sent = prefills(gateway)
    through_parrot = run(app, gateway, "parrot", cfg)
    assert prefills(gateway) > sent  # some of its calls were prefilled ahead
    assert through_parrot.parts == plain.parts
    assert through_parrot.output == plain.output
    assert through_parrot.prompt_tokens[-1] == plain.prompt_tokens[-1]


def chat(http: httpx.Client, content: str, **extra: Any) -> dict[str, Any]:
    response = http.post("/chat/completions", json={"model": SMOLLM, "messages": [{"role": "user", "content": content}],
                                                    **GREEDY, **extra})
    assert response.status_code in (200, 202), response.text
    return response.json()


def test_the_issues_map_reduce_with_queued_maps_answers_as_plain_requests(gateway):
    """Maps queued with ``wait: false``, a reduce whose placeholders follow a space: through the extension
    the maps' outputs reached the reduce as their token ids, 87 prompt tokens where the text is 83."""
    mapping, reducing = "Summarize in one sentence: {{chunk}}", "Combine these notes into one paragraph: " + " ".join(
        "{{s%d}}" % i for i in range(4))
    chunks = document(56, 4, 40)
    with httpx.Client(base_url=f"{gateway}/v1", timeout=300) as http:
        ids = {f"s{i}": chat(http, mapping, parrot={"vars": {"chunk": {"value": chunk}}, "wait": False,
                                                    "output": f"s{i}"})["parrot"]["output"]["id"]
               for i, chunk in enumerate(chunks)}
        reduced = chat(http, reducing, parrot={"vars": {name: {"id": var} for name, var in ids.items()}})
        summaries = {name: http.get(f"/vars/{var}", params={"wait": "true"}).json()["value"] for name, var in ids.items()}
        plain_maps = [chat(http, mapping.replace("{{chunk}}", chunk))["choices"][0]["message"]["content"]
                      for chunk in chunks]
        plain = chat(http, reducing.replace("{{s0}}", plain_maps[0]).replace("{{s1}}", plain_maps[1])
                     .replace("{{s2}}", plain_maps[2]).replace("{{s3}}", plain_maps[3]))
    assert list(summaries.values()) == plain_maps
    assert reduced["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert reduced["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]


def streamed(http: httpx.Client, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    text, usage = "", None
    with http.stream("POST", "/chat/completions", json={**body, "stream": True,
                                                        "stream_options": {"include_usage": True}}) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                text += "".join(c["delta"].get("content") or "" for c in chunk["choices"])
                usage = chunk.get("usage") or usage
    return text, usage


def test_a_streamed_semantic_request_streams_the_plain_answer_and_its_usage(gateway):
    system = "You answer questions about a city's transport in one sentence, and nothing else. " * 3
    question = "Which trains run on the railway in winter?"
    body = {"model": SMOLLM, **GREEDY, "messages": [{"role": "system", "content": system},
                                                    {"role": "user", "content": "{{question}}"}]}
    with httpx.Client(base_url=f"{gateway}/v1", timeout=300) as http:
        semantic = streamed(http, {**body, "parrot": {"vars": {"question": {"value": question}}}})
        plain = streamed(http, {**body, "messages": [body["messages"][0], {"role": "user", "content": question}]})
    assert semantic[0] == plain[0]
    assert semantic[1]["prompt_tokens"] == plain[1]["prompt_tokens"]
    assert "cached_tokens" in semantic[1]["prompt_tokens_details"]


def test_a_native_semantic_call_generates_what_plain_completions_do(gateway):
    """POST /v1/semantic_calls: each output generated after the text and outputs before it, as a client
    calling /v1/completions in turn would."""
    template = ("Notes on the railway of {{city}}:\nThe winter timetable {{output:first}}\n"
                "Because of that, {{output:second}}")
    stops = {"max_tokens": 12, "temperature": 0, "stop": ["\n"]}
    with httpx.Client(base_url=f"{gateway}/v1", timeout=300) as http:
        call = http.post("/semantic_calls", json={"model": SMOLLM, "template": template,
                                                  "inputs": {"city": {"value": "Greyhaven"}},
                                                  "outputs": {"first": stops, "second": stops}})
        assert call.status_code == 202, call.text
        outputs = {name: http.get(f"/vars/{view['id']}", params={"wait": "true"}).json()["value"]
                   for name, view in call.json()["outputs"].items()}
        prompt = "Notes on the railway of Greyhaven:\nThe winter timetable "
        first = http.post("/completions", json={"model": SMOLLM, "prompt": prompt, **stops}).json()["choices"][0]["text"]
        prompt += first + "\nBecause of that, "
        second = http.post("/completions", json={"model": SMOLLM, "prompt": prompt, **stops}).json()["choices"][0]["text"]
    assert outputs == {"first": first, "second": second}
