"""Which sequences a step serves: a latency-tuned batch for latency-critical work, big batches for
throughput work (EngineConfig.latency_max_num_seqs). Pure scheduling: no model runs."""

from __future__ import annotations

from engines.builtin.block_manager import BlockManager
from engines.builtin.config import EngineConfig
from engines.builtin.scheduler import BACKGROUND_PRIORITY, Scheduler
from engines.builtin.context import Context, Status
from engines.builtin.types import SamplingParams

BLOCK_SIZE = 4


def make_scheduler(latency_max_num_seqs: int | None, num_blocks: int = 64, max_num_seqs: int = 8,
                   max_num_batched_tokens: int = 2048) -> Scheduler:
    config = EngineConfig(block_size=BLOCK_SIZE, max_num_seqs=max_num_seqs, latency_max_num_seqs=latency_max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens)
    return Scheduler(config, BlockManager(num_blocks, BLOCK_SIZE))


def submit(scheduler: Scheduler, *, throughput: bool, priority: int = 0, prompt_len: int = 6) -> Context:
    first = 3 + 100 * len(scheduler.contexts)  # distinct prompts: no prefix-cache sharing between them
    ctx = Context(f"ctx{len(scheduler.contexts)}", list(range(first, first + prompt_len)))
    ctx.params = SamplingParams(max_tokens=8, throughput=throughput, priority=priority)
    scheduler.contexts[ctx.context_id] = ctx
    scheduler.add(ctx)
    return ctx


def step(scheduler: Scheduler) -> list[Context]:
    """One step as the engine runs it: schedule, then the batch's tokens are computed (and a token
    sampled for each sequence that reached its end)."""
    batch, _ = scheduler.schedule()
    scheduler.block_manager.commit()
    for ctx, n in batch.entries:
        ctx.num_computed_tokens += n
        if ctx.num_computed_tokens == len(ctx):
            ctx.token_ids.append(7)
    return [ctx for ctx, _ in batch.entries]


def test_latency_critical_work_gets_the_latency_batch_and_waits_its_turn():
    scheduler = make_scheduler(latency_max_num_seqs=2)
    chats = [submit(scheduler, throughput=False) for _ in range(4)]
    for _ in range(3):
        assert step(scheduler) == chats[:2]  # first come, first served; the others are not even admitted
    assert [ctx.status for ctx in chats] == [Status.RUNNING] * 2 + [Status.WAITING] * 2


def test_throughput_work_alone_is_batched_up_to_max_num_seqs():
    scheduler = make_scheduler(latency_max_num_seqs=2)
    maps = [submit(scheduler, throughput=True) for _ in range(6)]
    assert step(scheduler) == maps
    assert step(scheduler) == maps


def test_without_a_latency_limit_requests_are_batched_up_to_max_num_seqs():
    scheduler = make_scheduler(latency_max_num_seqs=None, max_num_seqs=4)
    chats = [submit(scheduler, throughput=False) for _ in range(6)]
    assert step(scheduler) == chats[:4]


def test_latency_critical_arrival_takes_seats_from_running_throughput_work():
    scheduler = make_scheduler(latency_max_num_seqs=2)
    maps = [submit(scheduler, throughput=True) for _ in range(4)]
    step(scheduler)
    chat = submit(scheduler, throughput=False, priority=-10)  # even below the maps' priority
    assert set(step(scheduler)) == {chat, maps[0]}
    # The maps left out sit the step out with their KV: nothing is preempted or recomputed.
    assert all(ctx.status is Status.RUNNING and ctx.block_table for ctx in maps)
    assert scheduler.num_preemptions == 0
    scheduler.remove(chat)  # the chat is done: the maps get the big batch back
    assert step(scheduler) == maps


def test_latency_critical_arrival_is_admitted_when_throughput_work_fills_max_num_seqs():
    scheduler = make_scheduler(latency_max_num_seqs=2, max_num_seqs=4)
    maps = [submit(scheduler, throughput=True) for _ in range(4)]
    step(scheduler)
    chat = submit(scheduler, throughput=False)
    assert set(step(scheduler)) == {chat, maps[0]}


def test_fills_need_no_seat():
    scheduler = make_scheduler(latency_max_num_seqs=1)
    chat = submit(scheduler, throughput=False)
    fills = []
    for i in range(3):
        fill = Context(f"fill{i}", list(range(1000 * (i + 1), 1000 * (i + 1) + 6)))
        scheduler.contexts[fill.context_id] = fill
        scheduler.add(fill)
        fills.append(fill)
    assert set(step(scheduler)) == {chat, *fills}


def test_a_sequence_seated_in_a_step_is_not_preempted_for_one_served_later_in_it():
    # Two blocks: a throughput map (earlier, so served before the chat by priority and arrival) and a
    # latency-critical chat, each holding one full block. Both need a new block to decode.
    scheduler = make_scheduler(latency_max_num_seqs=2, num_blocks=2)
    map_ = submit(scheduler, throughput=True, prompt_len=BLOCK_SIZE)
    chat = submit(scheduler, throughput=False, prompt_len=BLOCK_SIZE)
    assert set(step(scheduler)) == {map_, chat}  # each prompt fills its block; a token is sampled
    # The chat is seated first; the map, finding no room, gives way (it would have taken the chat's
    # block, though the chat is in the batch already).
    assert step(scheduler) == [chat]
    assert chat.status is Status.RUNNING and map_.status is Status.WAITING


def test_a_latency_critical_request_blocked_on_memory_is_not_overtaken_by_throughput_work():
    scheduler = make_scheduler(latency_max_num_seqs=2, num_blocks=5)
    hog = submit(scheduler, throughput=False, prompt_len=12)  # 3 blocks, and a 4th for its first decode
    step(scheduler)
    chat = submit(scheduler, throughput=False, prompt_len=8)  # needs 2 blocks: only 1 is left
    later = submit(scheduler, throughput=True, prompt_len=2)  # would fit in that one block
    assert step(scheduler) == [hog]
    assert (chat.status, later.status) == (Status.WAITING, Status.WAITING)


def test_a_prefix_hit_is_counted_once_however_long_its_sequence_waits_for_room():
    scheduler = make_scheduler(latency_max_num_seqs=None, num_blocks=6)
    shared = list(range(3, 3 + 4 * BLOCK_SIZE))  # four full blocks, cached by the first sequence
    first = Context("first", [*shared, 90])
    first.params = SamplingParams(max_tokens=8)
    scheduler.contexts["first"] = first
    scheduler.add(first)
    step(scheduler)
    second = Context("second", [*shared, 91, 92, 93, 94, 95])  # needs its own tail blocks: no room while first runs
    second.params = SamplingParams(max_tokens=8)
    scheduler.contexts["second"] = second
    scheduler.add(second)
    for _ in range(3):
        assert second not in step(scheduler)  # matched, no room, given back: each step
    assert scheduler.block_manager.prefix_hit_tokens == 0


def background_fill(scheduler: Scheduler, prompt_len: int) -> Context:
    """A fill nobody waits for, as the engine queues a gateway's prefix pinned ahead (ensure_context)."""
    first = 3 + 100 * len(scheduler.contexts)
    ctx = Context(f"ctx{len(scheduler.contexts)}", list(range(first, first + prompt_len)))
    ctx.background, ctx.fill_priority = True, BACKGROUND_PRIORITY
    scheduler.contexts[ctx.context_id] = ctx
    scheduler.add(ctx)
    return ctx


def test_background_fills_never_share_a_step_with_latency_critical_work():
    """A key's prefixes pinned ahead for calls that may never run cost no one else's request a step:
    a running one is set aside (its blocks released, no preemption counted) and none is admitted while
    latency-critical work runs or waits; they resume when it is done."""
    scheduler = make_scheduler(latency_max_num_seqs=None, max_num_batched_tokens=16)
    fills = [background_fill(scheduler, prompt_len=40) for _ in range(3)]
    assert step(scheduler) == fills[:1]  # the engine had nothing else to do
    chat = submit(scheduler, throughput=False, priority=-10)  # even below any gateway rank

    for _ in range(4):  # its prompt, then decodes
        assert step(scheduler) == [chat]  # budget to spare, but no fill rides along
    assert all(fill.status is Status.WAITING and not fill.block_table for fill in fills)
    assert scheduler.num_preemptions == 0

    scheduler.remove(chat)
    assert step(scheduler) == fills[:1]
