"""The global scheduler on hand-made engine views: prefix, load, criteria, task groups, capacity, removal."""

from __future__ import annotations

from engines.seam import EngineStats
from gateway.config import SchedulerConfig
from gateway.engine_view import EngineView
from gateway.prompt_prefix import CHUNK_BYTES, TOKENS_PER_CHUNK, chain, prompt_prefix
from gateway.scheduler import Placement, Scheduler, Warmed, Work

SYSTEM_A = "You are the travel agent of Parrot Airways. " * 40  # ~1,760 bytes: 6 full chunks
SYSTEM_B = "You are the librarian of the Parrot Library. " * 40


def views(count: int = 3) -> list[EngineView]:
    return [EngineView(id=f"e{i}", models=["m"]) for i in range(count)]


def work(system: str, user: str = "Hello?", **placement) -> Work:
    body = {"model": "m", "messages": [{"role": "system", "content": system}, {"role": "user", "content": user}]}
    prefix, tokens = prompt_prefix("chat/completions", body)
    return Work(prefix, tokens, Placement(**placement))


def place(scheduler: Scheduler, item: Work, engines: list[EngineView]) -> EngineView:
    chosen = scheduler.place(item, engines)
    assert chosen is not None
    return chosen


def test_requests_sharing_a_system_prompt_go_where_it_is_held():
    scheduler, engines = Scheduler(), views()
    first = place(scheduler, work(SYSTEM_A, "first question"), engines)
    first.in_flight += 1  # still running: the holder is busier than the others, and still wins
    assert {place(scheduler, work(SYSTEM_A, f"question {i}"), engines).id for i in range(3)} == {first.id}


def test_prompts_that_share_nothing_spread_over_idle_engines():
    scheduler, engines = Scheduler(), views()
    chosen = {place(scheduler, work(f"system prompt number {i}. " * 30), engines).id for i in range(3)}
    assert chosen == {"e0", "e1", "e2"}


def test_the_chain_matches_a_shared_head_and_not_what_follows():
    head = "x" * (3 * CHUNK_BYTES)
    same_head = chain("m", (head + "a" * CHUNK_BYTES).encode())
    other_tail = chain("m", (head + "b" * CHUNK_BYTES).encode())
    assert same_head[:3] == other_tail[:3] and same_head[3] != other_tail[3]
    assert chain("other-model", head.encode())[0] != same_head[0]  # engines key their caches by model too


def test_a_hot_prefix_is_replicated_once_its_holders_queue_costs_more_than_a_prefill():
    scheduler, engines = Scheduler(), views()
    holder = place(scheduler, work(SYSTEM_A), engines)
    item = work(SYSTEM_A, "next")
    queue_worth_a_prefill = item.prompt_tokens / scheduler.config.queue_tokens_per_request
    holder.in_flight = int(queue_worth_a_prefill) + 1
    second = place(scheduler, item, engines)
    assert second.id != holder.id
    # From now on both hold it: the next request goes to the less busy holder, not a third engine.
    second.in_flight = 1
    third = scheduler.best(work(SYSTEM_A, "again"), engines)
    assert third is not None and third.id == second.id


def test_throughput_work_packs_where_latency_work_spreads():
    engines = views()
    for latency, expected_same in ((False, True), (True, False)):
        scheduler = Scheduler()
        holder = place(scheduler, work(SYSTEM_A), engines)
        holder.in_flight = 3
        chosen = scheduler.best(work(SYSTEM_A, "more", latency=latency), engines)
        assert (chosen is holder) == expected_same, latency
        holder.in_flight = 0


def test_an_engine_far_above_the_least_loaded_is_passed_over_whatever_it_holds():
    config = SchedulerConfig(balance_abs_threshold=4, balance_ratio=1.5, throughput_queue_weight=0.0)
    scheduler, engines = Scheduler(config), views()
    holder = place(scheduler, work(SYSTEM_A), engines)
    holder.in_flight = 4  # at the threshold: throughput work (queue weight 0) still packs there
    assert scheduler.best(work(SYSTEM_A, latency=False), engines) is holder
    holder.in_flight = 5
    assert scheduler.best(work(SYSTEM_A, latency=False), engines) is not holder


def test_load_reported_by_the_engine_counts_as_well_as_the_gateways_own():
    scheduler, engines = Scheduler(), views(2)
    engines[0].stats = EngineStats(running=6, waiting=4)  # other clients' work, seen in its /metrics
    assert scheduler.best(work("a prompt nobody holds " * 30), engines) is engines[1]


def test_a_nearly_full_kv_cache_is_avoided():
    scheduler, engines = Scheduler(), views(2)
    engines[0].stats = EngineStats(blocks_total=100, blocks_free=2, block_size=16)
    assert {scheduler.best(work(f"prompt {i} " * 60), engines).id for i in range(4)} == {"e1"}


def test_a_task_group_shares_an_engine_when_it_shares_a_prefix_and_spreads_when_not():
    scheduler, engines = Scheduler(), views()
    members = []
    for i in range(4):  # placed in one burst: each still running when the next comes
        chosen = place(scheduler, work(SYSTEM_A, f"chunk {i}", latency=False, group="reduce-1"), engines)
        chosen.in_flight += 1
        members.append(chosen.id)
    assert len(set(members)) == 1

    for engine in engines:
        engine.in_flight = 0
    spread = []
    for i in range(3):
        chosen = place(scheduler, work(f"unrelated document {i}. " * 30, latency=False, group="reduce-2"), engines)
        chosen.in_flight += 1
        spread.append(chosen.id)
    assert len(set(spread)) == 3


def test_a_pinned_context_counts_as_held_whatever_the_mirror_says():
    scheduler, engines = Scheduler(), views()
    item = work(SYSTEM_B, held_by=frozenset({"e2"}))
    assert scheduler.best(item, engines) is engines[2]


def warmed_call(engine: str) -> Work:
    """A reduce whose instructions (~200 tokens) were prefilled ahead on ``engine``, its summaries since bound."""
    return work("Summarize these notes. " * 35, "The notes: " + "some summary text. " * 40,
                warmed=Warmed(engine, 200))


def test_a_warmed_call_runs_where_it_was_warmed_though_that_engine_is_somewhat_busier():
    scheduler, engines = Scheduler(), views()
    # The warmed engine runs a bigger batch and has a few requests just in: its next step takes them all in.
    engines[1].stats = EngineStats(running=20, waiting=3)
    engines[0].stats = engines[2].stats = EngineStats(running=8)
    item = warmed_call("e1")
    assert scheduler.best(item, engines) is engines[1]
    # Scored by load as any call, the same prompt goes elsewhere (12 requests more outweigh a 200-token prefix).
    assert scheduler.best(item._replace(placement=Placement()), engines) is not engines[1]


def test_a_warmed_call_leaves_a_saturated_engine_for_a_prefix_computed_again():
    scheduler, engines = Scheduler(), views()
    engines[1].stats = EngineStats(running=20, waiting=12)  # 4 beyond its next step: 1,024 tokens' wait > 200
    engines[0].stats = engines[2].stats = EngineStats(running=8)
    assert scheduler.best(warmed_call("e1"), engines) is not engines[1]
    engines[1].stats = EngineStats(running=8, blocks_total=100, blocks_free=2, block_size=16)  # KV cache full
    assert scheduler.best(warmed_call("e1"), engines) is not engines[1]


def test_a_warmed_call_weighs_the_prefix_it_saves_against_the_wait_it_meets():
    config = SchedulerConfig(next_step_requests=0, queue_tokens_per_request=100.0)
    scheduler, engines = Scheduler(config), views(2)
    engines[0].stats = EngineStats(running=4, waiting=1)  # one request ahead: 100 tokens' wait, 200 saved: stays
    assert scheduler.best(warmed_call("e0"), engines) is engines[0]
    engines[0].stats = EngineStats(running=4, waiting=3)  # 300 tokens' wait, 200 saved: computed again elsewhere
    assert scheduler.best(warmed_call("e0"), engines) is engines[1]


def test_what_an_engine_holds_is_bounded_by_its_kv_capacity():
    scheduler, engines = Scheduler(), views(2)
    engines[0].stats = EngineStats(blocks_total=8 * TOKENS_PER_CHUNK // 16, block_size=16)  # room for 8 chunks
    for i in range(5):
        scheduler.placed(work(f"prompt {i} " * 100), engines[0])
    assert scheduler.held_prefix_tokens("e0") == 8 * TOKENS_PER_CHUNK
    assert scheduler.held_tokens(work("prompt 0 " * 100)) == {}  # the oldest went first
    assert scheduler.held_tokens(work("prompt 4 " * 100))["e0"] > 0


def test_a_forgotten_engine_holds_nothing_and_leads_no_group():
    scheduler, engines = Scheduler(), views(2)
    scheduler.placed(work(SYSTEM_A, group="g"), engines[0])
    led = {scheduler.best(work(f"member {i} " * 60, group="g"), engines).id for i in range(4)}
    assert led == {"e0"}  # equal scores: the group's engine wins the tie
    scheduler.forget("e0")
    assert scheduler.held_tokens(work(SYSTEM_A)) == {}
    assert scheduler.held_prefix_tokens("e0") == 0
    spread = {scheduler.best(work(f"member {i} " * 60, group="g"), engines).id for i in range(4)}
    assert spread == {"e0", "e1"}  # no group engine any more: ties go round-robin


def test_one_off_prompts_do_not_push_a_shared_prompt_out_of_the_mirror():
    scheduler, engines = Scheduler(), views(1)
    engines[0].stats = EngineStats(blocks_total=30 * TOKENS_PER_CHUNK // 16, block_size=16)  # room for 30 chunks
    for i in range(2):  # a shared system prompt, used twice
        scheduler.placed(work(SYSTEM_A, f"question {i}"), engines[0])
    for i in range(20):  # then 20 prompts used once, 60 chunks in all: twice what the engine holds
        scheduler.placed(work(f"a one-off document {i}. " * 40), engines[0])
    assert scheduler.held_prefix_tokens("e0") == 30 * TOKENS_PER_CHUNK
    assert scheduler.held_tokens(work(SYSTEM_A))["e0"] >= 6 * TOKENS_PER_CHUNK


def test_an_affinity_key_keeps_its_engine_until_that_engine_is_overloaded():
    scheduler, engines = Scheduler(), views()
    first = place(scheduler, work(f"unrelated prompt {0}. " * 30, affinity="user-7"), engines)
    first.in_flight += 3  # busier than the others, still within the balance thresholds: the key stays
    assert {place(scheduler, work(f"unrelated prompt {i}. " * 30, affinity="user-7"), engines).id
            for i in range(1, 4)} == {first.id}
    first.in_flight += 20  # overloaded: the key moves, and stays where it went
    moved = place(scheduler, work("another prompt. " * 30, affinity="user-7"), engines)
    assert moved.id != first.id
    assert place(scheduler, work("yet another prompt. " * 30, affinity="user-7"), engines).id == moved.id
    scheduler.forget(moved.id)  # gone: the key is placed as any work
    assert place(scheduler, work("a last prompt. " * 30, affinity="user-7"), [first]).id == first.id


def test_placement_levels_order_latency_before_urgent_groups_before_throughput():
    assert Placement().level == 0
    assert Placement(latency=False, urgent=True, group="g").level == 1
    assert Placement(latency=False).level == 2


def test_an_engine_with_live_kv_events_is_matched_by_them_and_the_others_by_the_mirror():
    from engines.seam.kv_events import BlockRemoved, BlockStored
    from gateway.held_blocks import HeldBlocks

    scheduler, engines = Scheduler(), views()
    tokens = tuple(range(400))
    item = work(SYSTEM_A)._replace(token_ids=tokens, prompt_tokens=len(tokens))
    first = place(scheduler, item, engines)  # the mirror: it holds the prompt now
    held = {view.id: HeldBlocks() for view in engines}
    other = next(view for view in engines if view.id != first.id)
    held[other.id].apply([BlockStored(list(range(25)), None, list(tokens), 16, None, "GPU", None)])
    live = {first.id, other.id}
    scheduler.exact = lambda engine_id: held[engine_id] if engine_id in live else None
    # The first engine's events say it evicted the prompt (it holds nothing): the engine whose events say it
    # holds all of it wins, and the third engine's mirror (nothing placed there) counts as nothing.
    assert scheduler.held_tokens(item, engines) == {first.id: 0, other.id: 400}
    assert {place(scheduler, item, engines).id for _ in range(3)} == {other.id}
    held[other.id].apply([BlockRemoved([0], "GPU")])
    assert scheduler.held_tokens(item, engines)[other.id] == 0
    live.clear()  # the streams went silent: the mirror again
    assert scheduler.held_tokens(item, engines) == {first.id: len(item.prefix) * TOKENS_PER_CHUNK,
                                                    other.id: len(item.prefix) * TOKENS_PER_CHUNK}


def test_a_new_prompt_goes_to_an_engine_with_room_not_one_that_holds_only_its_first_block():
    from engines.seam.kv_events import BlockStored
    from gateway.held_blocks import HeldBlocks

    scheduler, engines = Scheduler(), views(2)
    for view in engines:
        view.stats = EngineStats(blocks_total=100, block_size=16)
    full, empty = HeldBlocks(), HeldBlocks()
    shared = list(range(16))  # the first block every prompt has (a chat template's header)
    full.apply([BlockStored(list(range(100)), None, shared + [1000 + i for i in range(99 * 16)], 16, None, "GPU",
                            None)])
    scheduler.exact = {"e0": full, "e1": empty}.get
    item = work(SYSTEM_A)._replace(token_ids=tuple(shared + [5] * 800), prompt_tokens=816)
    assert scheduler.held_tokens(item, engines) == {"e0": 16, "e1": 0}
    assert place(scheduler, item, engines).id == "e1"  # e0 would evict 800 tokens of what it holds
