"""Semantic variables on the real builtin engine (SmolLM2), behind a real gateway: forked prefixes,
block accounting and prefix-hit metrics."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.support.models import SMOLLM

from tests.support.waiting import wait_until
from tests.support import plain_http

# Every test here loads a model in an engine process (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.model, pytest.mark.subprocess]

SYSTEM = ("You are a careful assistant for a museum of natural history. Answer in one short sentence, "
          "plainly, without lists. Visitors ask about animals, fossils and the building itself.")


def ask(question: str, parrot: dict | None = None, **extra) -> dict:
    body = {"model": SMOLLM, "temperature": 0, "max_tokens": 12,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}], **extra}
    if parrot is not None:
        body["parrot"] = parrot
    return body


@pytest.fixture(scope="module")
def urls(smollm_gateway) -> dict[str, str]:
    return smollm_gateway


@pytest.fixture
def gw(urls) -> httpx.Client:
    with httpx.Client(base_url=urls["gateway"], timeout=120) as client:
        yield client


def engine_stats(urls) -> dict:
    return plain_http.get(f"{urls['engine']}/v1/stats", headers={"authorization": f"Bearer {urls['secret']}"}).json()


def metric(gw, name: str) -> float:
    """A metric's value summed over its labels (0 before it is first set)."""
    return sum(sample.value for family in text_string_to_metric_families(gw.get("/metrics").text)
               for sample in family.samples if sample.name == name)


def submit_waiting(gw, urls, system: str, name: str, var_id: str, session: str | None = None) -> httpx.Response:
    """Submits a call (``system`` prompt, ``{{name}}`` bound to the unset ``var_id``) without waiting, and
    returns its 202 once the engine holds its warmed prefix (fewer free blocks than before)."""
    baseline = engine_stats(urls)["blocks_free"]
    body = ask("{{%s}}" % name, {"wait": False, "vars": {name: {"id": var_id}}} | (
        {"session_id": session} if session else {}))
    body["messages"][0]["content"] = system
    answer = gw.post("/v1/chat/completions", json=body)
    assert answer.status_code == 202, answer.text
    wait_until(lambda: engine_stats(urls)["blocks_free"] < baseline, timeout_s=30)  # warmed: input still missing
    return answer


def test_forked_prefix_answers_exactly_like_a_plain_request(gw):
    plain = gw.post("/v1/chat/completions", json=ask("What do fossils tell us?")).json()
    session = gw.post("/v1/sessions").json()["id"]
    before = metric(gw, "parrot:shared_prefix_fork_tokens")
    answers = []
    for question in ["Where are the dinosaurs?", "What do fossils tell us?"]:
        response = gw.post("/v1/chat/completions", json=ask(
            "{{q}}", {"session_id": session, "vars": {"q": {"value": question}}}))
        assert response.status_code == 200, response.text
        answers.append(response.json())
    # greedy, same tokens: forking the system prompt must not change the answer
    assert answers[1]["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert answers[1]["usage"]["prompt_tokens"] == plain["usage"]["prompt_tokens"]
    assert metric(gw, "parrot:shared_prefix_fork_tokens") > before  # the second request forked the first's prefix
    gw.delete(f"/v1/sessions/{session}")


def test_deleting_a_session_returns_engine_blocks_to_baseline(gw, urls):
    baseline = engine_stats(urls)["blocks_free"]
    session = gw.post("/v1/sessions").json()["id"]
    response = gw.post("/v1/chat/completions", json=ask(
        "{{q}}", {"session_id": session, "vars": {"q": {"value": "Is the building old?"}}}))
    assert response.status_code == 200
    assert engine_stats(urls)["blocks_free"] < baseline  # the session pins its shared prefix on the engine
    deleted = gw.delete(f"/v1/sessions/{session}").json()
    assert deleted["freed_contexts"] == 1
    assert engine_stats(urls)["blocks_free"] == baseline


def test_a_waiting_call_fills_its_shared_prefix_before_its_input_is_ready(gw, urls):
    system = "You answer questions about the solar system in one short sentence, for a school planetarium show."
    session = gw.post("/v1/sessions").json()["id"]
    question = gw.post("/v1/vars", json={"session_id": session, "name": "q"}).json()["id"]
    baseline = engine_stats(urls)["blocks_free"]
    forked_before = metric(gw, "parrot:shared_prefix_fork_tokens")
    answer = submit_waiting(gw, urls, system, "q", question, session)  # the prefix filled, the input missing
    assert gw.put(f"/v1/vars/{question}", json={"value": "Which planet is largest?"}).status_code == 200
    output = answer.json()["parrot"]["output"]["id"]
    result = gw.get(f"/v1/vars/{output}", params={"wait": "true", "timeout": 120}).json()
    assert result["ready"] and result["error"] is None and result["value"].strip()
    assert metric(gw, "parrot:shared_prefix_fork_tokens") > forked_before  # the run forked the warmed prefix
    assert gw.delete(f"/v1/sessions/{session}").json()["freed_contexts"] == 1
    assert engine_stats(urls)["blocks_free"] == baseline


def test_prefix_cache_hits_are_counted_for_plain_requests_sharing_a_system_prompt(gw, urls):
    before = engine_stats(urls)["prefix_hit_tokens"]
    for question in ["Do you have whales?", "Do you have birds?"]:
        assert gw.post("/v1/chat/completions", json=ask(question)).status_code == 200
    assert engine_stats(urls)["prefix_hit_tokens"] > before
    deadline = time.monotonic() + 10  # the gauge follows the engine's heartbeats
    while metric(gw, "parrot:prefix_cache_hit_tokens") <= before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert metric(gw, "parrot:prefix_cache_hit_tokens") > before


def test_map_reduce_with_reduce_submitted_first(gw):
    session = gw.post("/v1/sessions").json()["id"]
    parts = ["Lions live in Africa.", "Penguins live in Antarctica."]
    maps = [gw.post("/v1/vars", json={"session_id": session, "name": f"m{i}"}).json()["id"] for i in range(2)]
    reduce = gw.post("/v1/chat/completions", json={
        "model": SMOLLM, "temperature": 0, "max_tokens": 16,
        "messages": [{"role": "user", "content": "Combine: {{a}} {{b}}"}],
        "parrot": {"session_id": session, "wait": False, "output": "final",
                   "vars": {"a": {"id": maps[0]}, "b": {"id": maps[1]}}}})
    assert reduce.status_code == 202
    final = reduce.json()["parrot"]["output"]["id"]
    for part, var in zip(parts, maps):
        gw.post("/v1/chat/completions", json=ask(
            "Repeat: {{doc}}", {"session_id": session, "wait": False, "vars": {"doc": {"value": part}},
                                "output": {"id": var}}))
    result = gw.get(f"/v1/vars/{final}", params={"wait": "true", "timeout": 120, "criteria": "latency"}).json()
    assert result["ready"] and result["error"] is None and result["value"].strip()
    values = [gw.get(f"/v1/vars/{v}").json()["value"] for v in maps]
    assert all(v.strip() for v in values)
    gw.delete(f"/v1/sessions/{session}")


def test_an_inline_map_reduce_runs_its_maps_as_a_task_group(gw):
    """One request: the reduce with its maps inline. The maps are one task group (batched, feeding the reduce),
    the reduce starts after both, and each map's output is readable by the id the answer lists."""
    session = gw.post("/v1/sessions").json()["id"]
    parts = {"a": "Lions live in Africa.", "b": "Penguins live in Antarctica."}
    maps = {k: {"call": ask("Repeat: {{doc}}", {"vars": {"doc": {"value": part}}})} for k, part in parts.items()}
    answer = gw.post("/v1/chat/completions", json={
        "model": SMOLLM, "temperature": 0, "max_tokens": 16, "messages": [{"role": "user", "content": "Combine: {{a}} {{b}}"}],
        "parrot": {"session_id": session, "vars": maps}})

    assert answer.status_code == 200, answer.text
    assert answer.json()["choices"][0]["message"]["content"].strip()
    inline = {k: view["id"] for k, view in answer.json()["parrot"]["inline"].items()}
    assert all(gw.get(f"/v1/vars/{inline[k]}").json()["value"].strip() for k in parts)
    calls = {c["id"]: c for c in gw.get(f"/v1/sessions/{session}/graph").json()["calls"]}
    producers = {v["id"]: v["producer"] for v in gw.get(f"/v1/sessions/{session}/graph").json()["variables"]}
    map_calls = [calls[producers[inline[k]]] for k in parts]
    reduce = next(c for c in calls.values() if c["id"] not in {m["id"] for m in map_calls} and c["inputs"])
    assert map_calls[0]["group"] is not None and map_calls[0]["group"] == map_calls[1]["group"]
    assert all(c["state"] == "done" for c in calls.values())
    assert reduce["finished"] >= max(m["finished"] for m in map_calls)
    gw.delete(f"/v1/sessions/{session}")


def test_semantic_call_with_two_outputs_on_the_engine(gw):
    response = gw.post("/v1/semantic_calls", json={
        "model": SMOLLM,
        "template": ("The following is a quiz about world capitals, with short answers.\n"
                     "Q: What is the capital of {{input:country}}?\nA: {{output:capital}}\n"
                     "Q: What is the capital of Italy?\nA: {{output:second}}"),
        "inputs": {"country": {"value": "France"}},
        "outputs": {"capital": {"max_tokens": 4, "temperature": 0, "stop": ["\n"]},
                    "second": {"max_tokens": 4, "temperature": 0, "stop": ["\n"]}}})
    assert response.status_code == 202, response.text
    outputs = response.json()["outputs"]
    capital = gw.get(f"/v1/vars/{outputs['capital']['id']}", params={"wait": "true", "timeout": 120}).json()
    second = gw.get(f"/v1/vars/{outputs['second']['id']}", params={"wait": "true", "timeout": 120}).json()
    assert "Paris" in capital["value"]
    assert "Rome" in second["value"]


def test_deleting_a_session_mid_request_frees_its_prefix_when_the_request_unwinds(gw, urls):
    system = "You write long, patient stories about lighthouses and their keepers, for children at bedtime."
    baseline = engine_stats(urls)["blocks_free"]
    session = gw.post("/v1/sessions").json()["id"]
    body = ask("{{q}}", {"session_id": session, "vars": {"q": {"value": "Tell me a story."}}},
               max_tokens=400, ignore_eos=True)
    body["messages"][0]["content"] = system
    answers: list[httpx.Response] = []
    request = threading.Thread(target=lambda: answers.append(gw.post("/v1/chat/completions", json=body)))
    request.start()
    deadline = time.monotonic() + 60
    while engine_stats(urls)["blocks_free"] >= baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_stats(urls)["blocks_free"] < baseline  # the prefix and its fork are on the engine

    deleted = gw.delete(f"/v1/sessions/{session}").json()
    request.join(timeout=60)

    assert answers[0].status_code == 409, answers[0].text
    assert deleted["freed_contexts"] == 1
    deadline = time.monotonic() + 10  # the engine drops the fork once it sees its request gone
    while engine_stats(urls)["blocks_free"] != baseline and time.monotonic() < deadline:
        time.sleep(0.05)
    assert engine_stats(urls)["blocks_free"] == baseline


def test_forked_requests_are_counted_like_plain_ones(gw):
    session = gw.post("/v1/sessions").json()["id"]
    names = ["parrot:request_success_total", "parrot:prompt_tokens_total", "parrot:generation_tokens_total",
             "parrot:e2e_request_latency_seconds_count"]
    before = {name: metric(gw, name) for name in names}
    forks_before = metric(gw, "parrot:shared_prefix_fork_tokens")
    answers = [gw.post("/v1/chat/completions", json=ask(
        "{{q}}", {"session_id": session, "vars": {"q": {"value": question}}})).json()
        for question in ["Is the museum open late?", "Can I take photos?"]]
    assert metric(gw, "parrot:shared_prefix_fork_tokens") > forks_before  # the second one forked
    assert metric(gw, names[0]) - before[names[0]] == 2
    assert metric(gw, names[1]) - before[names[1]] == sum(a["usage"]["prompt_tokens"] for a in answers)
    assert metric(gw, names[2]) - before[names[2]] == sum(a["usage"]["completion_tokens"] for a in answers)
    assert metric(gw, names[3]) - before[names[3]] == 2
    gw.delete(f"/v1/sessions/{session}")


def test_semantic_call_outputs_sample_like_completions(gw):
    prompt = "The museum's oldest fossil is"
    sampling = {"temperature": 0, "max_tokens": 9, "max_completion_tokens": 3, "logit_bias": {"28": 100}}
    plain = gw.post("/v1/completions", json={"model": SMOLLM, "prompt": prompt, "temperature": 0,
                                             "max_tokens": 3, "logit_bias": {"28": 100}}).json()
    call = gw.post("/v1/semantic_calls", json={"model": SMOLLM, "template": prompt + "{{output:o}}",
                                               "outputs": {"o": sampling}})
    assert call.status_code == 202, call.text
    output = gw.get(f"/v1/vars/{call.json()['outputs']['o']['id']}", params={"wait": "true", "timeout": 120}).json()
    assert output["value"] == plain["choices"][0]["text"]  # 3 tokens, biased: both fields reached the engine


def test_an_image_in_a_semantic_request_is_refused_not_dropped(gw):
    body = ask("{{q}}", {"vars": {"q": {"value": "What is this?"}}})
    body["messages"][1]["content"] = [{"type": "text", "text": "{{q}}"},
                                      {"type": "image_url", "image_url": {"url": "https://example.com/fossil.png"}}]
    response = gw.post("/v1/chat/completions", json=body)
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages[1].content[1]"


def test_a_waiting_calls_warmed_prefix_outlives_evictions_until_the_call_runs(gw, urls):
    """DAG-aware retention: a prefix filled for a call still waiting for its input is held for that call,
    so a stream of other prefixes (more than ``max_prefixes_per_engine``) does not evict it meanwhile."""
    system = "You name the capital city of a country in one word, for a geography quiz read out on the radio."
    question = gw.post("/v1/vars", json={"name": "country"}).json()["id"]  # the key's default session
    answer = submit_waiting(gw, urls, system, "country", question)

    others = gw.post("/v1/sessions").json()["id"]  # deleted at the end, with every prefix it pinned
    for i in range(33):  # one more than the gateway keeps per engine: an idle, unreserved prefix would go
        other = ask("{{x}}", {"session_id": others, "vars": {"x": {"value": "Hi."}}}, max_tokens=1)
        other["messages"][0]["content"] = f"Prompt number {i}: you reply with one word only, politely, to anything."
        assert gw.post("/v1/chat/completions", json=other).status_code == 200
    forked_before = metric(gw, "parrot:shared_prefix_fork_tokens")

    assert gw.put(f"/v1/vars/{question}", json={"value": "France"}).status_code == 200
    output = answer.json()["parrot"]["output"]["id"]
    result = gw.get(f"/v1/vars/{output}", params={"wait": "true", "timeout": 120}).json()
    assert result["ready"] and result["error"] is None
    assert metric(gw, "parrot:shared_prefix_fork_tokens") > forked_before  # forked the prefix warmed for it
    gw.delete(f"/v1/sessions/{others}")  # other tests count engine blocks: the cache is left as it was


@pytest.mark.parametrize("system", [SYSTEM, None], ids=["forked-prefix", "plain"])
def test_a_streamed_semantic_request_streams_tokens_as_they_are_generated(urls, system):
    """``stream: true`` with the extension: several content chunks, the same text as the request not streamed
    (greedy), the output variable bound to it, and the usage chunk when asked for."""
    from openai import OpenAI

    client = OpenAI(base_url=f"{urls['gateway']}/v1", api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Tell me about {{animal}} in two sentences."}]
    if system is not None:
        messages.insert(0, {"role": "system", "content": system})
    parrot = {"vars": {"animal": {"value": "elephants"}}, "output": "about"}
    whole = client.chat.completions.create(model=SMOLLM, messages=messages, temperature=0, max_tokens=24,
                                           extra_body={"parrot": parrot})
    raw = client.chat.completions.with_raw_response.create(
        model=SMOLLM, messages=messages, temperature=0, max_tokens=24, stream=True,
        stream_options={"include_usage": True}, extra_body={"parrot": parrot})
    assert raw.headers["x-parrot-engine"]
    chunks = list(raw.parse())

    content = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert len(content) > 1  # tokens as they came, not one replayed chunk
    assert "".join(content) == whole.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 24
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    output = chunks[0].model_extra["parrot"]["output"]["id"]
    value = plain_http.get(f"{urls['gateway']}/v1/vars/{output}", params={"wait": "true", "timeout": 60},
                      headers={"authorization": "Bearer none"}).json()["value"]  # the default session of its key
    assert value == whole.choices[0].message.content
