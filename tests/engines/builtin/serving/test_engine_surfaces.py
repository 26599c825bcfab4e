"""``BuiltinEngine``'s surfaces as its HTTP app calls them (a decoded request in, the response or its SSE events
out), in-process, over a real ``EngineCore`` running a tiny random Llama with a 96-token window."""

from __future__ import annotations

import asyncio
import json

import msgspec
import pytest

from engines.builtin.config import EngineConfig
from engines.builtin.serving import BuiltinEngine, EngineBadRequest
from engines.builtin.tokenizer import chat_prompt_tokens
from engines.builtin.types import SamplingParams
from wire.openai import ChatCompletionRequest, ChatMessage, CompletionRequest, encoder
from wire.sse import sse_event

WINDOW = 96
pytestmark = [pytest.mark.timeout(300), pytest.mark.model]  # the session's tiny model is made by the first test here


@pytest.fixture(scope="module")
def llm(tiny_model_dir):
    from engines.builtin.core import EngineCore

    core = EngineCore(EngineConfig(model=str(tiny_model_dir), max_model_len=WINDOW, num_blocks=64))
    core.start()
    yield core
    core.shutdown()


@pytest.fixture
def engine(llm) -> BuiltinEngine:
    return BuiltinEngine(llm, name="builtin-test", model_name="tiny")


def _surface_and_request(engine: BuiltinEngine, route: str, body: dict):
    """The surface the HTTP app's route calls, and the request it decoded from ``body``
    (engines/builtin/server/app.py)."""
    if route == "chat/completions":
        return engine.chats, msgspec.convert(body, ChatCompletionRequest)
    return engine.completions, msgspec.convert(body, CompletionRequest)


async def create(engine: BuiltinEngine, route: str, body: dict) -> dict:
    surface, request = _surface_and_request(engine, route, body)
    return msgspec.json.decode(encoder.encode(await surface.create(request)))


async def stream(engine: BuiltinEngine, route: str, body: dict):
    """The SSE events the HTTP app sends for a streamed request, one or more per item."""
    surface, request = _surface_and_request(engine, route, body)
    chunks = surface.stream(request)
    try:
        async for chunk in chunks:
            yield sse_event(chunk)
    finally:
        await chunks.aclose()


def chat_body(**fields) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, **fields}


async def test_reports_health_and_stats(engine, llm):
    assert await engine.health()
    stats = await engine.stats()
    assert stats.blocks_total == 64


async def test_max_tokens_defaults_to_the_rest_of_the_window(engine):
    reply = await create(engine, "chat/completions", chat_body(ignore_eos=True))
    usage = reply["usage"]
    assert usage["prompt_tokens"] + usage["completion_tokens"] == WINDOW
    assert reply["choices"][0]["finish_reason"] == "length"
    assert reply["model"] == "tiny" and reply["object"] == "chat.completion"


async def test_max_tokens_limit_bounds_a_request_without_max_tokens_below_the_room_left(engine):
    limited = await create(engine, "chat/completions", chat_body(ignore_eos=True, max_tokens_limit=5))
    roomy = await create(engine, "chat/completions", chat_body(ignore_eos=True, max_tokens_limit=10**6))

    assert limited["usage"]["completion_tokens"] == 5 and limited["choices"][0]["finish_reason"] == "length"
    assert roomy["usage"]["prompt_tokens"] + roomy["usage"]["completion_tokens"] == WINDOW  # no 400: the room left


async def test_legacy_completions_default_to_16_tokens_as_openai(engine):
    reply = await create(engine, "completions", {"model": "tiny", "prompt": "Hello", "ignore_eos": True})
    limited = await create(engine, "completions", {"model": "tiny", "prompt": "Hello", "ignore_eos": True,
                                                   "max_tokens_limit": 3})

    assert reply["usage"]["completion_tokens"] == 16 and reply["choices"][0]["finish_reason"] == "length"
    assert limited["usage"]["completion_tokens"] == 3


async def test_greedy_choices_match_and_stream_matches_create(engine):
    body = chat_body(max_tokens=10, ignore_eos=True, n=3)
    created = await create(engine, "chat/completions", body)
    texts = [c["message"]["content"] for c in created["choices"]]
    assert len(set(texts)) == 1 and texts[0]
    assert created["usage"]["completion_tokens"] == 30

    chunks = [json.loads(c) for c in await _payloads(stream(engine, "chat/completions", {**body, "stream": True}))]
    streamed = ["".join(c["choices"][0]["delta"].get("content", "") for c in chunks if c["choices"][0]["index"] == i) for i in range(3)]
    assert streamed == texts


async def _payloads(stream) -> list[bytes]:
    """The JSON payloads of a seam stream: whole SSE events, one or more per item."""
    events = b"".join([item async for item in stream])
    assert events.endswith(b"\n\n")
    return [e[len(b"data: "):] for e in events.split(b"\n\n") if e]


async def test_completion_stream_is_sse_events_with_a_usage_chunk(engine):
    body = {"model": "tiny", "prompt": ["one two", "three"], "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "stream": True, "stream_options": {"include_usage": True}}
    decoded = [json.loads(c) for c in await _payloads(stream(engine, "completions", body))]
    assert b"[DONE]" not in b"".join([c async for c in stream(engine, "completions", body)])
    assert decoded[-1]["choices"] == [] and decoded[-1]["usage"]["completion_tokens"] == 8
    assert {c["choices"][0]["index"] for c in decoded[:-1]} == {0, 1}
    finals = [c["choices"][0] for c in decoded[:-1] if c["choices"][0]["finish_reason"]]
    assert sorted(f["index"] for f in finals) == [0, 1] and {f["finish_reason"] for f in finals} == {"length"}


async def test_echo_prefixes_the_prompt(engine):
    body = {"model": "tiny", "prompt": "one two", "max_tokens": 3, "temperature": 0, "echo": True}
    reply = await create(engine, "completions", body)
    assert reply["choices"][0]["text"].startswith("one two")


async def test_echo_with_logprobs_scores_the_prompt_tokens_too(engine, llm):
    """Evaluation harnesses read loglikelihoods this way: echo, logprobs, one generated token."""
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 1, "temperature": 0, "echo": True, "logprobs": 2}
    prompt_tokens = llm.tokenizer.encode("one two three", add_special_tokens=False)

    reply = await create(engine, "completions", body)
    streamed = [json.loads(event[6:]) for event in _events(await _stream_bytes(engine, body))]

    logprobs = reply["choices"][0]["logprobs"]
    scores = await llm.score(prompt_tokens, 2)
    assert len(logprobs["tokens"]) == len(prompt_tokens) + 1
    assert "".join(logprobs["tokens"]) == reply["choices"][0]["text"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None  # nothing precedes it
    assert logprobs["token_logprobs"][1:-1] == pytest.approx([s.logprob for s in scores], abs=1e-5)
    for token, logprob, top in zip(logprobs["tokens"][1:], logprobs["token_logprobs"][1:], logprobs["top_logprobs"][1:]):
        assert 2 <= len(top) <= 3 and top[token] == pytest.approx(logprob, abs=1e-5)  # the chosen one is always there
    assert logprobs["text_offset"][:2] == [0, len(logprobs["tokens"][0])]
    greedy = logprobs["top_logprobs"][-1]  # the generated token was the most likely one
    assert logprobs["token_logprobs"][-1] == pytest.approx(max(greedy.values()), abs=1e-5)
    echoed = streamed[0]["choices"][0]
    assert echoed["text"] == "one two three" and echoed["logprobs"]["tokens"] == logprobs["tokens"][:-1]
    assert echoed["logprobs"]["token_logprobs"] == logprobs["token_logprobs"][:-1]


async def test_echo_with_max_tokens_0_scores_the_prompt_and_generates_nothing(engine):
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 0, "echo": True, "logprobs": 0}

    reply = await create(engine, "completions", body)
    streamed = [json.loads(event[6:]) for event in _events(await _stream_bytes(engine, body))]

    choice = reply["choices"][0]
    assert choice["text"] == "one two three" and choice["finish_reason"] == "length"
    assert reply["usage"]["completion_tokens"] == 0
    assert len(choice["logprobs"]["tokens"]) == reply["usage"]["prompt_tokens"]
    lp = choice["logprobs"]
    assert lp["top_logprobs"][1:] == [{t: p} for t, p in zip(lp["tokens"][1:], lp["token_logprobs"][1:])]  # the chosen only
    assert streamed[0]["choices"][0]["logprobs"] == choice["logprobs"]
    assert streamed[-1]["choices"][0]["finish_reason"] == "length" and streamed[-1]["choices"][0]["text"] == ""
    with pytest.raises(EngineBadRequest) as no_echo:
        await create(engine, "completions", {**body, "echo": False})
    assert no_echo.value.param == "max_tokens"


async def test_echo_offsets_follow_the_text_for_characters_split_across_tokens(engine):
    text = "naïve 日本語 café 🙂 ok"
    body = {"model": "tiny", "prompt": text, "max_tokens": 2, "temperature": 0, "echo": True, "logprobs": 0,
            "ignore_eos": True}

    logprobs = (await create(engine, "completions", body))["choices"][0]["logprobs"]

    offsets = logprobs["text_offset"]
    assert offsets == sorted(offsets) and offsets[0] == 0
    echoed = offsets[: len(offsets) - 2]
    assert echoed[-1] < len(text) <= offsets[-2]  # the generated tokens start after the echo


async def test_a_prompt_filling_the_window_can_be_scored(engine):
    tokens = list(range(1000, 1000 + WINDOW))
    body = {"model": "tiny", "prompt": tokens, "max_tokens": 0, "echo": True, "logprobs": 1}

    reply = await create(engine, "completions", body)

    assert len(reply["choices"][0]["logprobs"]["tokens"]) == WINDOW
    with pytest.raises(EngineBadRequest):  # one token more than fits: no room to generate
        await create(engine, "completions", {**body, "max_tokens": 1})


async def _stream_bytes(engine, body) -> bytes:
    return b"".join([events async for events in stream(engine, "completions", {**body, "stream": True})])


def _events(raw: bytes) -> list[bytes]:
    return [event for event in raw.split(b"\n\n") if event.startswith(b"data: {")]


@pytest.mark.parametrize(
    ("route", "body", "param"),
    [
        ("chat/completions", chat_body(messages=[{"role": "user", "content": "word " * WINDOW}]), "messages"),
        ("chat/completions", chat_body(stop_token_ids=[10**9]), "stop_token_ids"),
        ("completions", {"model": "tiny", "prompt": [[1, 2], [10**9]]}, "prompt"),
        ("completions", {"model": "tiny", "prompt": []}, "prompt"),
    ],
)
async def test_bad_requests_raise_400_engine_errors(engine, route, body, param):
    with pytest.raises(EngineBadRequest) as caught:
        await create(engine, route, body)
    assert caught.value.status_code == 400 and caught.value.param == param
    with pytest.raises(EngineBadRequest):
        async for _ in stream(engine, route, {**body, "stream": True}):
            pass


async def test_stop_token_id_ends_the_choice_without_its_text(engine, llm):
    prompt = chat_prompt_tokens(llm.tokenizer, [ChatMessage(role="user", content="Hello there")])
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    ids = [event.token_id async for event in llm.generate_from_prompt(prompt, greedy)]
    stop_id = next(t for i, t in enumerate(ids) if i >= 2 and t not in ids[:i])
    cut = await create(engine, "chat/completions", chat_body(max_tokens=8, ignore_eos=True, stop_token_ids=[stop_id]))
    assert cut["choices"][0]["finish_reason"] == "stop"
    assert cut["choices"][0]["message"]["content"] == llm.tokenizer.decode(ids[: ids.index(stop_id)])


async def test_closing_a_stream_aborts_and_frees_everything(engine, llm):
    baseline = (await engine.stats()).blocks_free
    body = chat_body(max_tokens=60, ignore_eos=True, n=2, stream=True)
    events = stream(engine, "chat/completions", body)
    received = 0
    async for _ in events:
        received += 1
        if received == 6:
            break
    await events.aclose()
    async with asyncio.timeout(10):  # a safety net: aborts are applied by the engine thread between steps
        while (stats := await engine.stats()).running or stats.waiting or stats.blocks_free != baseline:
            await asyncio.sleep(0.01)


async def test_context_primitives_fill_fork_generate_free(engine):
    from engines.builtin.serving import ContextFillRequest, ContextGenerateRequest, EngineNotFound

    baseline = (await engine.stats()).blocks_free
    parent = await engine.contexts.fill(ContextFillRequest(text="one two three four five six seven eight " * 3))
    child = await engine.contexts.fill(ContextFillRequest(parent_context_id=parent.context_id, text=" nine ten"))
    assert child.num_tokens > parent.num_tokens
    assert child.cached_tokens >= parent.num_tokens // 16 * 16  # the parent's full blocks are shared
    request = ContextGenerateRequest(temperature=0, max_tokens=5, ignore_eos=True)
    first = await asyncio.wait_for(engine.contexts.generate(child.context_id, request), 20)
    assert len(first.token_ids) == first.usage.completion_tokens == 5 and first.finish_reason == "length"
    # The output was appended to the child: a later fill lands after it.
    extended = await engine.contexts.fill(ContextFillRequest(context_id=child.context_id, tokens=[42]))
    assert extended.num_tokens == child.num_tokens + 5 + 1
    assert await engine.contexts.free(child.context_id) >= 1
    await engine.contexts.free(parent.context_id)
    assert (await engine.stats()).blocks_free == baseline
    with pytest.raises(EngineNotFound):
        await engine.contexts.free(child.context_id)


async def test_a_fork_without_max_tokens_stops_at_its_max_tokens_limit(engine):
    from engines.builtin.serving import ContextFillRequest, ContextGenerateRequest

    parent = await engine.contexts.fill(ContextFillRequest(text="one two three four five six seven eight"))
    request = ContextGenerateRequest(temperature=0, ignore_eos=True, fork=True, text=" nine", max_tokens_limit=4)
    try:
        generation = await asyncio.wait_for(engine.contexts.generate(parent.context_id, request), 20)
    finally:
        await engine.contexts.free(parent.context_id)
    assert len(generation.token_ids) == 4 and generation.finish_reason == "length"


async def test_the_service_tier_asked_is_echoed_and_the_usage_counts_cached_prompt_tokens(engine):
    body = chat_body(max_tokens=2, service_tier="flex", stream_options={"include_usage": True})
    created = await create(engine, "chat/completions", {k: v for k, v in body.items() if k != "stream_options"})
    assert created["service_tier"] == "flex"
    assert (await create(engine, "chat/completions", chat_body(max_tokens=2)))["service_tier"] == "default"
    chunks = [json.loads(c) for c in await _payloads(stream(engine, "chat/completions", {**body, "stream": True}))]
    assert {c["service_tier"] for c in chunks} == {"flex"}
    assert chunks[-1]["usage"]["prompt_tokens_details"]["cached_tokens"] > 0  # the same prompt a third time


async def test_the_stop_string_that_ended_a_choice_is_its_stop_reason(engine):
    body = chat_body(max_tokens=12, ignore_eos=True)
    text = (await create(engine, "chat/completions", body))["choices"][0]["message"]["content"]
    stop = text[len(text) // 2:len(text) // 2 + 2]
    assert stop.strip(), text

    stopped = (await create(engine, "chat/completions", {**body, "stop": [stop]}))["choices"][0]
    assert stopped["finish_reason"] == "stop" and stopped["stop_reason"] == stop
    assert stopped["message"]["content"] == text[:text.index(stop)]
    assert (await create(engine, "chat/completions", body))["choices"][0]["stop_reason"] is None
    chunks = [json.loads(c) for c in await _payloads(stream(engine, "chat/completions", {**body, "stop": [stop],
                                                                                         "stream": True}))]
    assert [c["choices"][0]["stop_reason"] for c in chunks if c["choices"][0]["finish_reason"]] == [stop]
    async with asyncio.timeout(10):  # the sequences a stop string ended are aborted between steps: gone before
        while (stats := await engine.stats()).running or stats.waiting:  # this test's loop closes
            await asyncio.sleep(0.01)
