"""The engine server over real HTTP on loopback, driven by the openai SDK, on the real SmolLM2.

One engine (model loaded once) serves every test; the registration tests put a second app in
front of the same core.
"""

from __future__ import annotations

import asyncio
import json
import os
import threading
from typing import NamedTuple

import httpx
import openai
import pytest
from litestar import Litestar, Request, Response, post
from litestar.params import FromPath

from engines.builtin.server.app import DEFAULT_SERVED_MODEL_NAME, GatewayRegistration, create_app
from tests.support.waiting import wait_until

os.environ.setdefault("HF_HUB_OFFLINE", "1")

MODEL = DEFAULT_SERVED_MODEL_NAME
FRANCE = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0, "max_tokens": 12}
# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = [pytest.mark.timeout(120), pytest.mark.model]


@pytest.fixture(scope="module")
def client(base_url) -> openai.OpenAI:
    return openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def http(base_url):
    with httpx.Client(base_url=base_url, timeout=30) as c:
        yield c


def settled_stats(http) -> dict:
    """The engine's stats once no request is in flight. A request ended by a stop string or a client leaving
    is aborted by the engine's next step, after its reply went out: until then an earlier test's request still
    holds blocks, and a baseline read then would count them as used."""
    return wait_until(lambda: (stats := http.get("/v1/stats").json())["running"] == stats["waiting"] == 0 and stats)


@pytest.fixture(scope="module")
def greedy_answer(client) -> str:
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, **GREEDY)
    return reply.choices[0].message.content


# ---------------------------------------------------------------- OpenAI routes


def test_greedy_smollm2_knows_the_capital_of_france(client):
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=30)
    assert "Paris" in reply.choices[0].message.content
    assert reply.choices[0].finish_reason == "stop"  # ended on <|im_end|>, which is not in the text
    assert "<|im_end|>" not in reply.choices[0].message.content
    usage = reply.usage
    assert usage.prompt_tokens == 37  # SmolLM2's template with its default system prompt
    assert 0 < usage.completion_tokens < 30
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens


def test_echo_logprobs_score_a_prompt_as_evaluation_harnesses_read_it(client):
    """Loglikelihood the way lm-eval and friends ask for it: echo the prompt with logprobs and
    generate nothing (max_tokens 0) or one token; a likely continuation outscores an unlikely one."""
    def score(text: str) -> float:
        reply = client.completions.create(model=MODEL, prompt=text, echo=True, logprobs=1, max_tokens=0)
        choice = reply.choices[0]
        assert choice.text == text and choice.finish_reason == "length" and reply.usage.completion_tokens == 0
        assert choice.logprobs.token_logprobs[0] is None and len(choice.logprobs.tokens) == reply.usage.prompt_tokens
        return sum(choice.logprobs.token_logprobs[1:])

    one_more = client.completions.create(model=MODEL, prompt="The capital of France is", echo=True, logprobs=1,
                                         max_tokens=1, temperature=0)

    assert score("The capital of France is Paris") > score("The capital of France is Banana")
    logprobs = one_more.choices[0].logprobs
    assert len(logprobs.tokens) == one_more.usage.prompt_tokens + 1
    # the most likely token, and always the chosen one (OpenAI's legacy logprobs: up to logprobs + 1)
    for token, logprob, top in zip(logprobs.tokens[1:], logprobs.token_logprobs[1:], logprobs.top_logprobs[1:]):
        assert 1 <= len(top) <= 2 and top[token] == pytest.approx(logprob, abs=1e-5)


def test_null_means_the_default_for_nullable_fields(http):
    nulls = {"n": None, "stream": None, "ignore_eos": None, "priority": None}
    chat = http.post("/v1/chat/completions", json={
        "model": MODEL, "messages": FRANCE, "max_tokens": 2, "logprobs": None, **nulls})
    completion = http.post("/v1/completions", json={
        "model": MODEL, "prompt": "Hi", "max_tokens": 2, "temperature": 0, "echo": None, **nulls})

    assert chat.status_code == completion.status_code == 200, (chat.text, completion.text)
    assert len(chat.json()["choices"]) == 1 and chat.json()["choices"][0]["logprobs"] is None
    assert not completion.json()["choices"][0]["text"].startswith("Hi")  # no echo


def test_max_tokens_ends_with_length(client, greedy_answer):
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, temperature=0, max_tokens=3)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 3
    assert greedy_answer.startswith(reply.choices[0].message.content)


def test_streamed_chat_with_two_choices_and_usage(client, greedy_answer):
    chunks = list(
        client.chat.completions.create(
            model=MODEL, messages=FRANCE, n=2, stream=True, stream_options={"include_usage": True}, **GREEDY
        )
    )
    assert len({c.id for c in chunks}) == 1
    *content_chunks, usage_chunk = chunks
    assert usage_chunk.choices == [] and usage_chunk.usage.prompt_tokens == 37
    for index in (0, 1):
        mine = [c.choices[0] for c in content_chunks if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"  # the first chunk of each choice carries the role
        assert all(c.delta.role is None for c in mine[1:])
        assert [c.finish_reason for c in mine[:-1]] == [None] * (len(mine) - 1)
        assert mine[-1].finish_reason in ("stop", "length")
        # Greedy choices are forks of one filled prompt and must match an n=1 request exactly.
        assert "".join(c.delta.content or "" for c in mine) == greedy_answer
    tokens_per_choice = usage_chunk.usage.completion_tokens / 2
    assert tokens_per_choice == int(tokens_per_choice) > 0


def test_completions_with_a_list_prompt(client):
    prompts = ["The capital of France is", "1, 2, 3, 4,"]
    both = client.completions.create(model=MODEL, prompt=prompts, temperature=0, max_tokens=6)
    assert [c.index for c in both.choices] == [0, 1]
    for prompt, choice in zip(prompts, both.choices):
        alone = client.completions.create(model=MODEL, prompt=prompt, temperature=0, max_tokens=6)
        assert choice.text == alone.choices[0].text
    assert both.choices[1].text.startswith(" 5")
    assert both.usage.completion_tokens == 12


def test_completions_accept_token_ids_and_report_logprobs(client, smollm2_core):
    prompt_ids = smollm2_core.tokenizer.encode("The capital of France is", add_special_tokens=False)
    reply = client.completions.create(model=MODEL, prompt=prompt_ids, temperature=0, max_tokens=4, logprobs=2)
    as_text = client.completions.create(model=MODEL, prompt="The capital of France is", temperature=0, max_tokens=4)
    assert reply.choices[0].text == as_text.choices[0].text
    lp = reply.choices[0].logprobs
    assert "".join(lp.tokens) == reply.choices[0].text
    assert all(v <= 0 for v in lp.token_logprobs)
    # Greedy picks the most likely token, so it heads its own top-2.
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and max(top.values()) == pytest.approx(logprob, abs=1e-4) and token in top


def test_chat_logprobs(client):
    reply = client.chat.completions.create(
        model=MODEL, messages=FRANCE, logprobs=True, top_logprobs=3, temperature=0, max_tokens=5
    )
    content = reply.choices[0].logprobs.content
    assert len(content) == reply.usage.completion_tokens == 5
    assert "".join(t.token for t in content) == reply.choices[0].message.content
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob, abs=1e-4)
        assert bytes(entry.bytes).decode() == entry.token


def test_stop_string_spanning_tokens_cuts_the_reply(client, greedy_answer):
    assert "is Paris" in greedy_answer  # " is" and " Paris" are separate tokens
    expected = greedy_answer[: greedy_answer.index("is Par")]
    reply = client.chat.completions.create(model=MODEL, messages=FRANCE, stop=["is Par", "zzz"], **GREEDY)
    assert reply.choices[0].message.content == expected
    assert reply.choices[0].finish_reason == "stop"
    assert reply.usage.completion_tokens < 12

    deltas = [
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(model=MODEL, messages=FRANCE, stop="is Par", stream=True, **GREEDY)
    ]
    assert "".join(deltas) == expected
    assert not any("is P" in d for d in deltas)


def test_seeded_sampling_is_reproducible(client):
    def sample(seed: int, n: int = 1) -> list[str]:
        reply = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Tell me a story."}], temperature=1.2, seed=seed,
            max_tokens=8, n=n,
        )
        return [c.message.content for c in reply.choices]

    first = sample(1234)
    assert sample(1234) == first
    assert len({first[0], sample(1)[0], sample(2)[0]}) > 1  # the seed does steer sampling
    # n seeded choices use seed, seed+1, ...: each equals the single request with that seed.
    pair = sample(1234, n=2)
    assert pair == [first[0], sample(1235)[0]]


def test_models_health_and_stats(http):
    assert http.get("/v1/models").json()["data"][0]["id"] == MODEL
    assert http.get("/health").json() == {"status": "ok"}
    stats = http.get("/v1/stats").json()
    assert stats["blocks_total"] == 128 and 0 <= stats["blocks_free"] <= 128


def test_client_disconnect_aborts_the_generation(http, wait_until):
    baseline = settled_stats(http)["blocks_free"]
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 500, "ignore_eos": True, "stream": True, "n": 2}
    with http.stream("POST", "/v1/chat/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        for _ in range(8):
            next(lines)
    # 500 tokens would take far longer than this wait: only an abort frees the slots this soon.
    wait_until(lambda: (s := http.get("/v1/stats").json())["running"] == 0 and s["blocks_free"] == baseline, timeout_s=15)


def test_client_leaving_a_non_streaming_request_aborts_the_generation(http, wait_until):
    baseline = settled_stats(http)["blocks_free"]
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 500, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        http.post("/v1/chat/completions", json=body, timeout=1.0)
    wait_until(lambda: (s := http.get("/v1/stats").json())["running"] == 0 and s["blocks_free"] == baseline, timeout_s=15)


# ---------------------------------------------------------------- errors


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"]
    return error


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"model": MODEL}, "messages"),
        ({"model": MODEL, "messages": FRANCE, "temperature": "hot"}, "temperature"),
        ({"model": MODEL, "messages": FRANCE, "temperature": 7}, "temperature"),
        ({"model": MODEL, "messages": [{"role": "robot", "content": "hi"}]}, "messages[0].role"),
        ({"model": MODEL, "messages": FRANCE, "top_logprobs": 2}, "top_logprobs"),
        ({"model": MODEL, "messages": FRANCE, "logit_bias": {"999999": 1}}, "logit_bias"),
    ],
)
def test_bad_bodies_are_openai_shaped_400s(http, body, param):
    error = _error(http.post("/v1/chat/completions", json=body), 400)
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_unparseable_json_is_a_400(http):
    _error(http.post("/v1/chat/completions", content=b"{not json", headers={"content-type": "application/json"}), 400)


def test_unknown_model_is_a_404(client):
    with pytest.raises(openai.NotFoundError) as caught:
        client.chat.completions.create(model="gpt-17", messages=FRANCE)
    assert caught.value.body["code"] == "model_not_found"


def test_prompt_longer_than_the_window_is_a_400(client, http):
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hello " * 2100}])
    body = {"model": MODEL, "prompt": "hello " * 2100, "stream": True}
    _error(http.post("/v1/completions", json=body), 400)  # a plain error, not a 200 stream


@pytest.mark.parametrize("extra", [{"suffix": " end"}, {"best_of": 3}])
def test_completion_options_this_engine_lacks_are_400s_not_ignored(http, extra):
    error = _error(http.post("/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 2, **extra}), 400)

    assert error["param"] == next(iter(extra))


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_asking_for_more_tokens_than_the_window_holds_is_a_400(http, field):
    error = _error(http.post("/v1/chat/completions", json={"model": MODEL, "messages": FRANCE, field: 10**6}), 400)

    assert error["param"] == field and "context window" in error["message"]
    assert error["code"] == "context_length_exceeded"


# ---------------------------------------------------------------- Parrot primitives


def test_fill_fork_generate_free_returns_blocks_to_baseline(http):
    baseline = settled_stats(http)["blocks_free"]
    system = "You are a geography expert. Answer in one short sentence. " * 3
    parent = http.post("/v1/contexts", json={"text": system}).json()
    assert parent["num_tokens"] > 16 and parent["cached_tokens"] <= parent["num_tokens"]
    question = "Q: What is the capital of France?\nA:"
    child = http.post("/v1/contexts", json={"parent_context_id": parent["context_id"], "text": question}).json()
    assert child["context_id"] != parent["context_id"]
    assert child["cached_tokens"] >= parent["num_tokens"] // 16 * 16  # the parent's full blocks are shared
    generated = http.post(
        f"/v1/contexts/{child['context_id']}/generate", json={"temperature": 0, "max_tokens": 8}
    ).json()
    assert set(generated) == {"text", "token_ids", "finish_reason", "usage", "context_tokens"}
    assert generated["context_tokens"] == child["num_tokens"]
    assert len(generated["token_ids"]) == generated["usage"]["completion_tokens"] <= 8
    assert "Paris" in generated["text"]

    # The generation was appended: continuing streams on after it.
    events = _sse_events(
        http.post(f"/v1/contexts/{child['context_id']}/generate", json={"temperature": 0, "max_tokens": 3, "stream": True})
    )
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert chunks[-1]["finish_reason"] == "length"
    assert sum(len(c["token_ids"]) for c in chunks) == 3
    # The last chunk counts the whole generation, as the non-streamed answer does; no other chunk does.
    assert chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["context_tokens"] == child["num_tokens"] + len(generated["token_ids"])
    assert not any("usage" in c or "context_tokens" in c for c in chunks[:-1])

    freed = http.delete(f"/v1/contexts/{child['context_id']}").json()["freed_blocks"]
    assert freed >= 1
    http.delete(f"/v1/contexts/{parent['context_id']}")
    assert http.get("/v1/stats").json()["blocks_free"] == baseline


def test_forked_generation_leaves_the_parent_as_it_was(http):
    baseline = settled_stats(http)["blocks_free"]
    system = "You are a geography expert. Answer in one short sentence. " * 3
    parent = http.post("/v1/contexts", json={"text": system}).json()
    question = "Q: What is the capital of France?\nA:"
    answers = [http.post(f"/v1/contexts/{parent['context_id']}/generate",
                         json={"temperature": 0, "max_tokens": 8, "fork": True, "text": question}).json()
               for _ in range(2)]
    assert "Paris" in answers[0]["text"] and answers[0]["text"] == answers[1]["text"]  # parent unchanged
    assert answers[0]["usage"]["prompt_tokens"] > 0  # the forked suffix
    assert _error(http.post(f"/v1/contexts/{parent['context_id']}/generate",
                            json={"max_tokens": 2, "text": "no fork"}), 400)["param"] == "fork"
    assert _error(http.post(f"/v1/contexts/{parent['context_id']}/generate",
                            json={"max_tokens": 2, "fork": True}), 400)["param"] == "text"
    http.delete(f"/v1/contexts/{parent['context_id']}")
    assert http.get("/v1/stats").json()["blocks_free"] == baseline


async def test_forks_sent_at_once_create_their_context_and_share_its_kv(http, base_url):
    baseline = settled_stats(http)
    # Its end and the fork's start meet at a pre-token boundary (as a gateway cuts prefixes), so the prompt,
    # their text as one text, keeps the context's tokens and the forks follow it.
    system = ("You are a geography expert. Answer in one short sentence. " * 3).rstrip()
    context_id = f"prefix-{os.urandom(8).hex()}"
    body = {"temperature": 0, "max_tokens": 8, "fork": True, "text": "\nQ: What is the capital of France?\nA:",
            "context_text": system}
    async with httpx.AsyncClient(base_url=base_url, timeout=30) as client:
        answers = [r.json() for r in await asyncio.gather(*(
            client.post(f"/v1/contexts/{context_id}/generate", json=body) for _ in range(3)))]
    assert all("Paris" in a["text"] for a in answers)
    pinned = http.post("/v1/contexts", json={"context_id": context_id, "text": "ignored", "if_absent": True}).json()
    assert pinned["cached_tokens"] == pinned["num_tokens"] == answers[0]["context_tokens"]  # it exists, untouched
    # The context and three forks: the prefix's full blocks are computed once, by whichever came first.
    full_block_tokens = pinned["num_tokens"] // 16 * 16
    assert http.get("/v1/stats").json()["prefix_hit_tokens"] - baseline["prefix_hit_tokens"] >= 3 * full_block_tokens
    http.delete(f"/v1/contexts/{context_id}")
    assert http.get("/v1/stats").json()["blocks_free"] == baseline["blocks_free"]


def test_an_if_absent_fill_creates_once_and_needs_a_context_id(http):
    baseline = settled_stats(http)["blocks_free"]
    context_id = f"pin-{os.urandom(8).hex()}"
    body = {"context_id": context_id, "text": "Hello there", "if_absent": True}
    created, again = http.post("/v1/contexts", json=body).json(), http.post("/v1/contexts", json=body).json()
    assert created["context_id"] == context_id and created["cached_tokens"] == 0
    assert again["cached_tokens"] == again["num_tokens"] == created["num_tokens"]  # left as it was, not appended
    assert _error(http.post("/v1/contexts", json={"text": "Hello", "if_absent": True}), 400)["param"] == "if_absent"
    assert _error(http.post("/v1/contexts/x/generate", json={"max_tokens": 2, "context_text": "Hello"}),
                  400)["param"] == "context_text"
    http.delete(f"/v1/contexts/{context_id}")
    assert http.get("/v1/stats").json()["blocks_free"] == baseline


class KeptTurn(NamedTuple):
    """A conversation's first turn forked with keep_as, and its next turn's fork body."""

    ids: tuple[str, str, str]  # the prefix's context, the kept one, a fresh one for the plain answer
    first: dict
    prompt_tokens: int  # the first turn's whole prompt
    follow_up: dict  # the next turn's fork, its context_text the next prompt's start


def _kept_turn(http) -> KeptTurn:
    system = ("You are a geography expert. Answer in one short sentence. " * 3).rstrip()
    question = "\nQ: What is the capital of France?\nA:"
    context_id, kept_id, fresh_id = (f"{name}-{os.urandom(8).hex()}" for name in ("prefix", "kept", "fresh"))
    first = http.post(f"/v1/contexts/{context_id}/generate", json={
        **GREEDY, "fork": True, "text": question, "context_text": system, "keep_as": kept_id}).json()
    # The next prompt renders the answer, then its own turn markers where the generation went on otherwise.
    next_text = system + question + first["text"].rstrip() + " <end>\n"
    follow_up = {**GREEDY, "fork": True, "text": "Q: And of Italy?\nA:", "context_text": next_text}
    return KeptTurn((context_id, kept_id, fresh_id), first, first["context_tokens"] + first["usage"]["prompt_tokens"],
                    follow_up)


def _same_prompt(forked: dict, fresh: dict) -> bool:
    return (forked["context_tokens"] + forked["usage"]["prompt_tokens"]
            == fresh["context_tokens"] + fresh["usage"]["prompt_tokens"])


def test_a_kept_fork_trimmed_to_the_next_prompt_is_what_the_next_fork_follows(http):
    """A conversation's turn forked with keep_as keeps its context (prompt + output); trimmed to the next prompt's
    start, rendered with an ending other than the generated one, it keeps only the common prefix; the next fork
    follows it, computing only the rest, and answers as a fork of a context made from that text does (greedy)."""
    baseline = settled_stats(http)["blocks_free"]
    turn = _kept_turn(http)
    _, kept_id, fresh_id = turn.ids
    trimmed = http.post(f"/v1/contexts/{kept_id}/trim", json={"text": turn.follow_up["context_text"]}).json()
    assert turn.prompt_tokens < trimmed["num_tokens"] < turn.prompt_tokens + len(turn.first["token_ids"])
    forked = http.post(f"/v1/contexts/{kept_id}/generate", json=turn.follow_up).json()
    fresh = http.post(f"/v1/contexts/{fresh_id}/generate", json=turn.follow_up).json()
    assert forked["text"] == fresh["text"] and forked["token_ids"] == fresh["token_ids"]
    assert forked["context_tokens"] == trimmed["num_tokens"]  # followed, not recomputed
    assert _same_prompt(forked, fresh)
    assert _error(http.post(f"/v1/contexts/{kept_id}/generate", json={**GREEDY, "keep_as": "x"}),
                  400)["param"] == "keep_as"
    for name in turn.ids:
        http.delete(f"/v1/contexts/{name}")
    assert settled_stats(http)["blocks_free"] == baseline
    _error(http.post("/v1/contexts/nope/trim", json={"text": "hi"}), 404)


def test_a_fork_with_trim_trims_a_kept_context_to_its_text_and_follows_it(http):
    """The next turn's fork of a kept context with ``trim``: the context is trimmed to the common prefix of its tokens
    and the fork's context_text (as /trim would) and followed, in one call; the answer is a fresh context's (greedy)."""
    baseline = settled_stats(http)["blocks_free"]
    turn = _kept_turn(http)
    _, kept_id, fresh_id = turn.ids
    untrimmed = http.post(f"/v1/contexts/{kept_id}/generate", json=turn.follow_up).json()
    assert untrimmed["context_tokens"] == 0  # without trim: the kept context holds other tokens, not followed
    forked = http.post(f"/v1/contexts/{kept_id}/generate", json={**turn.follow_up, "trim": True}).json()
    fresh = http.post(f"/v1/contexts/{fresh_id}/generate", json=turn.follow_up).json()
    assert forked["token_ids"] == fresh["token_ids"] == untrimmed["token_ids"]
    assert turn.prompt_tokens < forked["context_tokens"] < turn.prompt_tokens + len(turn.first["token_ids"])
    assert _same_prompt(forked, fresh)
    again = http.post(f"/v1/contexts/{kept_id}/generate", json={**turn.follow_up, "trim": True}).json()
    assert again["context_tokens"] == forked["context_tokens"] and again["token_ids"] == forked["token_ids"]
    assert _error(http.post(f"/v1/contexts/{kept_id}/generate", json={**GREEDY, "fork": True, "text": "Q:",
                                                                     "trim": True}), 400)["param"] == "trim"
    for name in turn.ids:
        http.delete(f"/v1/contexts/{name}")
    assert settled_stats(http)["blocks_free"] == baseline


def test_unknown_context_is_a_404(http):
    assert _error(http.post("/v1/contexts/nope/generate", json={"max_tokens": 2}), 404)["code"] == "context_not_found"
    _error(http.post("/v1/contexts/nope/generate", json={"max_tokens": 2, "stream": True}), 404)
    _error(http.delete("/v1/contexts/nope"), 404)
    _error(http.post("/v1/contexts", json={"parent_context_id": "nope", "text": "hi"}), 404)


def test_fill_needs_exactly_one_of_tokens_and_text(http):
    _error(http.post("/v1/contexts", json={}), 400)
    _error(http.post("/v1/contexts", json={"text": "a", "tokens": [1]}), 400)
    _error(http.post("/v1/contexts", json={"tokens": "abc"}), 400)


@pytest.mark.parametrize("field", [{"temperature": -1}, {"top_p": 1.5}, {"top_k": -2}, {"top_logprobs": 50}])
def test_generate_rejects_out_of_range_sampling_fields(http, field):
    context = http.post("/v1/contexts", json={"text": "Hello"}).json()["context_id"]
    try:
        assert _error(http.post(f"/v1/contexts/{context}/generate", json=field), 400)["param"] == next(iter(field))
    finally:
        http.delete(f"/v1/contexts/{context}")


def _sse_events(response: httpx.Response) -> list[str]:
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    frames = response.text.split("\n\n")
    assert frames[-1] == ""
    assert all(f.startswith("data: ") for f in frames[:-1])
    return [f.removeprefix("data: ") for f in frames[:-1]]


# ---------------------------------------------------------------- gateway registration


class FakeGateway:
    """Just the two gateway routes an engine calls, recording what it receives."""

    def __init__(self, refuse_first: int = 0):
        self.registrations: list[dict] = []
        self.heartbeats: list[tuple[str, dict]] = []
        self.known: set[str] = set()
        self.refuse_first = refuse_first  # answer 503 this many times, as a gateway still starting
        self.lock = threading.Lock()

    def app(self) -> Litestar:
        @post("/v1/engines", status_code=200)
        async def register(request: Request) -> Response:
            with self.lock:
                if self.refuse_first:
                    self.refuse_first -= 1
                    return Response({"error": "starting"}, status_code=503)
                body = await request.json()
                self.registrations.append(body)
                engine_id = f"engine-{len(self.registrations)}"
                self.known.add(engine_id)
            return Response({"id": engine_id, "token": f"token-{engine_id}"})

        @post("/v1/engines/{engine_id:str}/heartbeat", status_code=200)
        async def heartbeat(engine_id: FromPath[str], request: Request) -> Response:
            with self.lock:
                if engine_id not in self.known:
                    return Response({"error": "unknown engine"}, status_code=404)
                if request.headers.get("authorization") != f"Bearer token-{engine_id}":
                    return Response({"error": "not this engine's token"}, status_code=401)
                self.heartbeats.append((engine_id, await request.json()))
            return Response({"ok": True})

        return Litestar([register, heartbeat])


def test_engine_registers_heartbeats_and_reregisters_when_forgotten(smollm2_core, serve, wait_until):
    gateway = FakeGateway(refuse_first=2)
    gateway_url = serve(gateway.app())
    registration = GatewayRegistration(gateway_url, "http://127.0.0.1:9/engine", "builtin-test", heartbeat_interval_s=0.05)
    serve(create_app(llm=smollm2_core, registration=registration))

    wait_until(lambda: len(gateway.heartbeats) >= 2)
    assert gateway.registrations == [
        {"name": "builtin-test", "url": "http://127.0.0.1:9/engine", "models": [MODEL],
         "capabilities": ["contexts", "scheduling_hints"]}
    ]
    engine_id, stats = gateway.heartbeats[-1]
    assert engine_id == "engine-1"
    assert stats["blocks_total"] == 128 and set(stats) >= {"running", "waiting", "blocks_free"}

    with gateway.lock:
        gateway.known.clear()  # the gateway restarted and forgot us
    wait_until(lambda: any(e == "engine-2" for e, _ in gateway.heartbeats))
    assert len(gateway.registrations) == 2


def test_prompt_split_is_the_prompt_a_chat_request_becomes(http, client, smollm2_core):
    """/v1/prompt_split is what a gateway shares a prefix by: joined again it must be the engine's own
    prompt for the same messages, tool descriptions included; without variables it is cut where the last
    message starts."""
    weather = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}

    def split(body: dict) -> dict:
        return http.post("/v1/prompt_split", json={"route": "chat/completions", "body": body}).json()

    plain, with_tools = split({"messages": FRANCE}), split({"messages": FRANCE, "tools": [weather]})
    assert "get_weather" in with_tools["prefix"] and "get_weather" not in plain["prefix"]
    for answer, tools in ((plain, None), (with_tools, [weather])):
        assert [segment.keys() for segment in answer["rest"]] == [{"text"}]  # no variables
        assert FRANCE[-1]["content"] in answer["rest"][0]["text"] and FRANCE[-1]["content"] not in answer["prefix"]
        prompt = answer["prefix"] + answer["rest"][0]["text"]
        reply = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1,
                                               **({"tools": tools} if tools else {}))
        assert reply.usage.prompt_tokens == len(smollm2_core.tokenizer.encode(prompt, add_special_tokens=False))


def test_prompt_split_cuts_before_the_first_variable_and_its_whitespace(http):
    body = {"messages": [{"role": "system", "content": "You answer in one word."},
                         {"role": "user", "content": "The capital of {{country}} is {{input:what}}?"}]}
    answer = http.post("/v1/prompt_split", json={"route": "chat/completions", "body": body}).json()
    assert answer["prefix"].endswith("The capital of")  # the space goes with the value (BPE's rule)
    assert answer["rest"][:3] == [{"text": " "}, {"variable": "country"}, {"text": " is "}]
    assert answer["rest"][3] == {"variable": "what"}
    refused = http.post("/v1/prompt_split", json={"route": "completions", "body": {"prompt": ["a", "b"]}})
    assert refused.status_code == 400


def test_tools_stay_in_the_prompt_with_tool_choice_none(client):
    tools = [{"type": "function", "function": {"name": "get_time", "description": "The time now"}}]
    usage = {choice: client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1, tools=tools,
                                                     tool_choice=choice).usage.prompt_tokens
             for choice in ("auto", "none")}
    without = client.chat.completions.create(model=MODEL, messages=FRANCE, max_tokens=1).usage.prompt_tokens
    assert usage["none"] == usage["auto"] > without  # offered, as OpenAI does; the grammar keeps calls out


@pytest.mark.parametrize("part", [{"type": "image_url", "image_url": {"url": "https://example.com/cat.png"}},
                                  {"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}])
def test_media_parts_are_refused_not_dropped(client, part):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model=MODEL, max_tokens=1, messages=[
            {"role": "user", "content": [{"type": "text", "text": "Describe this"}, part]}])
    assert refused.value.body["param"] == "messages[0].content[1]"


@pytest.mark.parametrize("extra", [{"min_tokens": 5}, {"allowed_token_ids": [28]}, {"bad_words": ["Paris"]},
                                   {"include_stop_str_in_output": True}, {"guided_choice": ["yes", "no"]}])
def test_vllm_extras_it_does_not_implement_are_refused_not_ignored(http, extra):
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 2, **extra}
    assert _error(http.post("/v1/chat/completions", json=body), 400)["param"] == next(iter(extra))


def test_vllm_extras_at_their_defaults_are_fine(http):
    body = {"model": MODEL, "messages": FRANCE, "max_tokens": 2, "min_tokens": 0, "include_stop_str_in_output": False,
            "bad_words": [], "guided_json": {}}  # vLLM's own defaults, as clients dumping a full request send them
    assert http.post("/v1/chat/completions", json=body).status_code == 200
