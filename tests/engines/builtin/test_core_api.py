"""The in-process API's contract: errors the serving layer maps, aborts, freeing, stats."""

from __future__ import annotations

import asyncio
import sys

import pytest

from engines.builtin.errors import ContextBusy, ContextNotFound, PromptTooLong
from engines.builtin.types import SamplingParams
from tests.support.waiting import eventually

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = pytest.mark.model

ENDLESS = SamplingParams(max_tokens=100_000, temperature=0.0, ignore_eos=True)


async def wait_until(condition, timeout=10.0):
    await eventually(condition, timeout_s=timeout)


def all_free(engine) -> bool:
    stats = engine.stats()
    return stats.running == stats.waiting == 0 and stats.blocks_free == stats.blocks_total


async def test_unknown_context_raises_a_key_error(make_engine):
    engine = make_engine()
    with pytest.raises(ContextNotFound) as raised:
        async for _ in engine.generate("nope", ENDLESS):
            pass
    assert isinstance(raised.value, KeyError)
    with pytest.raises(ContextNotFound):
        engine.fork("nope")
    with pytest.raises(ContextNotFound):
        await engine.free_context("nope")
    with pytest.raises(ContextNotFound):
        await engine.fill([1, 2], parent_context_id="nope")


async def test_too_long_prompts_raise_a_value_error(make_engine):
    engine = make_engine(max_model_len=32)
    assert engine.max_model_len == 32
    with pytest.raises(PromptTooLong, match="maximum context length of 32"):
        await engine.fill(list(range(33)))
    with pytest.raises(ValueError):
        async for _ in engine.generate_from_prompt(list(range(40)), ENDLESS):
            pass
    parent = await engine.fill(list(range(30)))
    with pytest.raises(PromptTooLong):
        await engine.fill(list(range(5)), parent_context_id=parent.context_id)
    # A generation stops at the window.
    events = [e async for e in engine.generate(parent.context_id, ENDLESS)]
    assert len(events) == 2 and events[-1].finish_reason == "length"


async def test_closing_the_stream_aborts_and_frees(make_engine):
    engine = make_engine()
    stream = engine.generate_from_prompt(list(range(100, 140)), ENDLESS)
    assert (await anext(stream)).finish_reason is None
    await anext(stream)
    await stream.aclose()
    await wait_until(lambda: all_free(engine))
    assert engine.stats().generation_tokens < 50


async def test_cancelling_the_consumer_aborts(make_engine):
    engine = make_engine()
    started = asyncio.Event()

    async def consume():
        async for _ in engine.generate_from_prompt(list(range(100, 140)), ENDLESS):
            started.set()

    task = asyncio.create_task(consume())
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await wait_until(lambda: all_free(engine))


async def test_busy_context_and_freeing_a_running_one(make_engine):
    engine = make_engine()
    context = await engine.fill(list(range(100, 140)))
    stream = engine.generate(context.context_id, ENDLESS)
    await anext(stream)
    with pytest.raises(ContextBusy):
        await engine.fill([1], context_id=context.context_id)
    assert await engine.free_context(context.context_id) > 0
    events = [e async for e in stream]
    assert events[-1].finish_reason == "abort"
    await wait_until(lambda: all_free(engine))
    with pytest.raises(ContextNotFound):
        await engine.fill([1], context_id=None, parent_context_id=context.context_id)


async def test_an_id_freed_while_busy_can_be_taken_again_at_once(make_engine):
    engine = make_engine()
    prompt = list(range(100, 140))
    await engine.fill(prompt, context_id="reused")
    stream = engine.generate("reused", ENDLESS)
    await anext(stream)
    freeing = asyncio.create_task(engine.free_context("reused"))
    await asyncio.sleep(0)  # unlisted at once; its blocks go when the loop has aborted its generation
    assert engine.ensure_context("reused", prompt)  # a new context under the same id
    assert await freeing > 0  # the old one's blocks, not the new one's
    assert [e async for e in stream][-1].finish_reason == "abort"
    assert engine.context_length("reused") == len(prompt)
    await wait_until(lambda: engine.stats().waiting == engine.stats().running == 0)
    await engine.free_context("reused")
    await wait_until(lambda: all_free(engine))


async def test_generations_started_together_share_their_first_step(make_engine):
    """Forks started in one event-loop iteration (a gather, an app's fan-out) all reach the step thread's next step,
    even when it may take the GIL from the submitting thread after every few bytecodes."""
    engine = make_engine()
    parent = await engine.fill(list(range(100, 140)))
    await wait_until(lambda: engine._idle)  # the step thread waits for work, as between an app's calls
    params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)

    async def steps(prompt):
        return [e.step async for e in engine.generate_from_prompt(prompt, params, parent_context_id=parent.context_id)]

    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        runs = await asyncio.gather(*(steps([7 + i, 8, 9]) for i in range(8)))
    finally:
        sys.setswitchinterval(interval)
    assert len({first for first, *_ in runs}) == 1, f"the forks' first tokens came from steps {runs}"


async def test_a_batch_refused_partway_still_serves_what_it_admitted(make_engine):
    engine = make_engine(max_model_len=64)
    await wait_until(lambda: engine._idle)
    with pytest.raises(PromptTooLong):  # the first prompt is admitted, the second refused
        engine.generate_batch([list(range(100, 110)), list(range(100))], SamplingParams(max_tokens=2))
    await wait_until(lambda: engine.stats().waiting == engine.stats().running == 0)  # it ran: nothing else woke it


async def test_a_refused_fork_creates_no_parent(make_engine):
    engine = make_engine(max_model_len=64)
    with pytest.raises(PromptTooLong):
        await anext(engine.generate_from_prompt([5] * 40, ENDLESS, parent_context_id="p", parent_tokens=[7] * 40))
    assert engine.context_length("p") is None


async def test_fill_appends_and_stats_count(make_engine):
    engine = make_engine()
    first = await engine.fill(list(range(100, 120)), context_id="ctx")
    assert first.context_id == "ctx" and first.num_tokens == 20
    more = await engine.fill(list(range(200, 210)), context_id="ctx")
    assert (more.num_tokens, more.cached_tokens) == (30, 20)
    events = [e async for e in engine.generate("ctx", SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True))]
    assert len(events) == 3
    stats = engine.stats()
    assert stats.prompt_tokens == 30 and stats.generation_tokens == 3
    assert stats.cached_tokens == 32  # two full blocks published in the prefix cache
    # 33 tokens, but the last generated one has no KV yet: 32 rows, two blocks.
    assert await engine.free_context("ctx") == 2
