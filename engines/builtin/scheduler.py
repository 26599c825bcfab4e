"""Continuous batching: decodes and chunked prefills share each step under a token budget.

Order of service: running sequences by priority (higher first, then arrival), then waiting
ones. When blocks run out, idle contexts lose their KV first (least recently used; their full
blocks stay in the prefix cache), then the lowest-priority running sequence is preempted by
recompute: its blocks are dropped and it goes back to waiting.

With ``latency_max_num_seqs`` set, a step that has latency-critical work (running or waiting)
seats at most that many generations, latency-critical ones first (running, then waiting), then
throughput work in the seats left; throughput sequences left out keep their KV and sit the step
out, and a sequence already seated is never preempted for one served later in the step. Without
latency-critical work a step seats up to ``max_num_seqs``: work that said it can wait is what gets
the big batches. Fills (prefill only, often on a generation's critical path) need no seat.

Background fills (nobody waits for them: a gateway pinning a prefix ahead of its use) come last and
run only in steps without latency-critical work, running or waiting; when such work comes, a running
one is set aside (its blocks released, its full ones still cached) so that no one's request waits for
its compute or its memory.

The batch also says which decodes share leading KV blocks (forks of one context, prefix-cache
hits on one system prompt), so attention can read each shared prefix once for its group.
"""

from __future__ import annotations

import itertools
import time
from dataclasses import dataclass, field
from typing import Callable

from engines.builtin.block_manager import FREED, BlockManager
from engines.builtin.config import EngineConfig
from engines.builtin.model_runner import PrefixGroup, ScheduledBatch
from engines.builtin.context import Context, Status, next_arrival


BACKGROUND_PRIORITY = -(2**31)  # a background fill's: below any request's (wire.sampling.Priority)


def service_order(ctx: Context) -> tuple[int, int]:
    return (-ctx.priority, ctx.arrival)


def latency_first_order(ctx: Context) -> tuple[bool, int, int]:
    return (not ctx.latency_critical, *service_order(ctx))


def prefix_groups(decodes: list[Context], block_size: int) -> list[PrefixGroup]:
    """Groups of two or more decodes whose block tables start with the same blocks.

    The block manager shares only full blocks (by fork or prefix-cache hit), computed at the
    latest in this step before attention reads them, so equal leading block ids mean equal
    leading KV. Grouped by first block; a group's prefix is its members' longest common run of
    leading blocks.
    """
    by_first_block: dict[int, list[int]] = {}
    for i, ctx in enumerate(decodes):
        if ctx.num_computed_tokens >= block_size and ctx.block_table[0] != FREED:  # freed: windowed, never shared
            by_first_block.setdefault(ctx.block_table[0], []).append(i)
    groups = []
    for members in by_first_block.values():
        if len(members) < 2:
            continue
        tables = [decodes[i].block_table for i in members]
        limit = min(decodes[i].num_computed_tokens for i in members) // block_size
        shared = 1
        while shared < limit and all(table[shared] == tables[0][shared] for table in tables):
            shared += 1
        groups.append(PrefixGroup(shared, members))
    return groups


@dataclass
class _Step:
    """What one step has taken so far: its token budget, its seats and their entries. Seats are for
    generations; fills (prefill only, often on a generation's critical path) need none."""

    budget: int
    seats: int
    order: Callable[[Context], tuple] = service_order  # who is served first, hence who may preempt whom
    entries: list[tuple[Context, int]] = field(default_factory=list)
    generations: int = 0
    done_fills: list[Context] = field(default_factory=list)
    out_of_blocks: bool = False  # a waiting sequence found no room: none served after it is admitted
    urgent: bool = False  # latency-critical work is running or waiting: background fills sit out

    def has_seat(self, ctx: Context) -> bool:
        return ctx.is_fill or self.generations < self.seats

    def takes(self, ctx: Context) -> bool:
        return not (ctx.background and self.urgent)

    def add(self, ctx: Context, num_tokens: int, block_manager: BlockManager) -> None:
        block_manager.allocate(ctx, num_tokens)
        self.entries.append((ctx, num_tokens))
        self.generations += not ctx.is_fill
        self.budget -= num_tokens


def _in_pass(ctx: Context, latency_critical: bool | None) -> bool:
    return latency_critical is None or ctx.latency_critical == latency_critical


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.latency_max_num_seqs = config.latency_max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: list[Context] = []
        self.running: list[Context] = []
        self.contexts: dict[str, Context] = {}  # every live context, idle ones included
        self.num_preemptions = 0
        self.latency_preemptions = 0  # of those, latency-critical generations
        self.prefix_cache_queries = 0  # as vLLM counts them: tokens looked up at admission, and found
        self.prefix_cache_hits = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, ctx: Context) -> None:
        ctx.arrival = next_arrival()
        ctx.arrived_at = time.perf_counter()
        ctx.status = Status.WAITING
        self.waiting.append(ctx)

    def remove(self, ctx: Context) -> None:
        """Detaches ``ctx``'s request; the context itself stays (idle) unless temporary."""
        if ctx in self.running:
            self.running.remove(ctx)
        if ctx in self.waiting:
            self.waiting.remove(ctx)
        ctx.status = Status.IDLE

    def schedule(self) -> tuple[ScheduledBatch, list[Context]]:
        """Returns the step's batch and the waiting fills that turned out fully cached (done)."""
        self.running.sort(key=service_order)
        step = _Step(self.max_num_batched_tokens, self.max_num_seqs)
        step.urgent = any(ctx.latency_critical for ctx in itertools.chain(self.running, self.waiting))
        passes: tuple[bool | None, ...] = (None,)  # None: every sequence in one pass
        if self.latency_max_num_seqs is not None and step.urgent:
            step.seats, step.order, passes = self.latency_max_num_seqs, latency_first_order, (True, False)
        for latency_critical in passes:
            self._schedule_running(step, latency_critical)
            self._admit_waiting(step, latency_critical)
        entries = sorted(step.entries, key=lambda entry: entry[1] != 1)  # decodes first, as the runner expects
        decodes = [ctx for ctx, n in entries if n == 1]
        return ScheduledBatch(entries, prefix_groups(decodes, self.block_manager.block_size)), step.done_fills

    def _schedule_running(self, step: _Step, latency_critical: bool | None) -> None:
        for ctx in list(self.running):
            if step.budget == 0:
                return
            if ctx.status is not Status.RUNNING or not _in_pass(ctx, latency_critical) or not step.has_seat(ctx):
                continue  # preempted to make room for a sequence served before it, or not its turn
            if not step.takes(ctx):
                self._set_aside(ctx)
                continue
            n = min(ctx.num_pending_tokens, step.budget)
            if not self._make_room(ctx, n, step.order):
                self._preempt(ctx)
                continue
            step.add(ctx, n, self.block_manager)

    def _admit_waiting(self, step: _Step, latency_critical: bool | None) -> None:
        # Latency-critical work is admitted even when throughput work fills max_num_seqs: that sits out.
        limited = latency_critical is not True
        self.waiting.sort(key=service_order)  # sequences preempted this step included
        for ctx in list(self.waiting):
            if step.budget == 0 or step.out_of_blocks or (limited and len(self.running) >= self.max_num_seqs):
                return
            if not _in_pass(ctx, latency_critical) or not step.has_seat(ctx) or not step.takes(ctx):
                continue
            looked_up = ctx.num_pending_tokens
            reused = self.block_manager.match_prefix(ctx, self._reusable_tokens(ctx))
            if ctx.num_pending_tokens == 0:
                self.waiting.remove(ctx)
                step.done_fills.append(ctx)
                self._count_lookup(looked_up, reused)
                continue
            n = min(ctx.num_pending_tokens, step.budget)
            if not self._make_room(ctx, n, step.order, preempt_running=False):
                # Give back what matching took (full blocks stay cached): waiting sequences holding
                # blocks could starve the running ones. Nobody served later may overtake it.
                self.block_manager.release(ctx)
                self.block_manager.prefix_hit_tokens -= reused  # matched again when it is seated: counted then
                step.out_of_blocks = True
                return
            self.waiting.remove(ctx)
            self.running.append(ctx)
            ctx.status = Status.RUNNING
            step.add(ctx, n, self.block_manager)
            self._count_lookup(looked_up, reused)

    def _count_lookup(self, looked_up: int, found: int) -> None:
        """A prefix-cache lookup of an admitted request (one sent back for lack of room is counted when
        it is admitted)."""
        self.prefix_cache_queries += looked_up
        self.prefix_cache_hits += found

    @staticmethod
    def _reusable_tokens(ctx: Context) -> int:
        """How many of ``ctx``'s next tokens may come from the prefix cache instead of being computed."""
        if ctx.score_top_k is not None:
            # A scoring fill needs every position's logits: only the positions already scored (before
            # it was preempted) may be reused. Scores are keyed by the token they score: p needs row p - 1.
            return max(ctx.scores, default=0) - ctx.num_computed_tokens
        # A generation must compute at least its last token to get logits.
        return ctx.num_pending_tokens - (0 if ctx.is_fill else 1)

    def _make_room(self, ctx: Context, num_tokens: int, order: Callable[[Context], tuple], *,
                   preempt_running: bool = True) -> bool:
        while not self.block_manager.can_allocate(ctx, num_tokens):
            victim = self._idle_victim()
            if victim is None and preempt_running:
                victim = self._running_victim(ctx, order)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _idle_victim(self) -> Context | None:
        idle = [s for s in self.contexts.values() if s.status is Status.IDLE and s.block_table]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def _running_victim(self, ctx: Context, order: Callable[[Context], tuple]) -> Context | None:
        """The last-served running sequence, if it is served after ``ctx`` (so not yet in this step)."""
        candidates = [s for s in self.running if s.status is Status.RUNNING and s is not ctx]
        if not candidates:
            return None
        victim = max(candidates, key=order)
        return victim if order(victim) > order(ctx) else None

    def _set_aside(self, ctx: Context) -> None:
        """A running background fill goes back to waiting, its blocks released (its full ones stay in the
        prefix cache, so little is computed again): not a preemption of anyone's request."""
        self.block_manager.release(ctx)
        self.running.remove(ctx)
        ctx.status = Status.WAITING
        self.waiting.append(ctx)

    def _preempt(self, ctx: Context) -> None:
        self.block_manager.release(ctx)
        if ctx.status is Status.RUNNING:
            self.num_preemptions += 1
            self.latency_preemptions += ctx.latency_critical
            self.running.remove(ctx)
            ctx.status = Status.WAITING
            self.waiting.append(ctx)
