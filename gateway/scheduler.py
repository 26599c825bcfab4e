"""The global scheduler: which engine runs a request, plain or semantic, chosen from what Parrot knows of it
(its prompt's prefix, its criteria, its task group) and of the engines (their load, what they hold).

Pure: work and engine views in, a placement out. It remembers only what it placed: which prefix chunks each
engine holds (a segmented LRU mirror per engine, sized from the KV capacity it reports) and where each task group
went. No I/O, no clock, no awaits: the simulator (benchmarks/scheduler_sim.py) runs this same code. Where an engine
publishes its KV-cache events and they are live (gateway/kv_events.py), what it holds is read from them instead
(``exact``: the blocks it holds, matched against the work's token ids) and the mirror is only the fallback.

Each engine is scored by what the work would cost there, in prompt tokens computed:

    queue   = load × queue_tokens_per_request × (1, or throughput_queue_weight for throughput work)
    prefill = the prompt's tokens − the tokens of its prefix the engine holds
    evicted = of that prefill, what does not fit in the room its cache has left (engines with live KV events)
    score   = queue + prefill + evicted  (+ the prompt again when the KV cache is nearly full: it would preempt)

and the lowest score wins. So a request goes where its prefix is, unless that engine's queue costs more than
computing the prefix again elsewhere; then the prefix is replicated to a second engine, which holds it from
then on: a hot prefix spreads over as many engines as its traffic needs and no more (cache-aware routers
instead switch to the shortest queue past a fixed imbalance and lose the prefix). Throughput work minds the
queue less: it packs onto engines that hold its prefix, where it batches. An engine far above the least
loaded one (``balance_abs_threshold`` requests and ``balance_ratio`` times) is passed over whatever it
holds. A task group's members share the engine the first of them went to when it scores as well as any (so
they batch and finish together); without a shared prefix they spread like any work. Ties go round-robin.

A call prefilled ahead of its inputs (``Placement.warmed``: gateway/semantic/prefill.py) is scored by the cost
of the wait it would meet instead of the load: on a continuous-batching engine a newcomer joins the running
batch at the next step, so what delays it is the requests queued beyond what that step admits
(``next_step_requests``), each of which computes its prompt first (``queue_tokens_per_request``). So

    wait    = max(0, waiting − next_step_requests) × queue_tokens_per_request  (× the throughput discount)
    score   = wait + prefill + evicted  (+ the KV-full penalty), the warmed engine winning ties

the one trade made explicit, in the time one prompt token's prefill takes: the prefix tokens it saves there (what
it holds less what another holds) against the wait there less the wait elsewhere. The balance thresholds do not
pass it over: a bigger running batch is no wait (its engine is saturated when requests queue, or its KV cache
fills). Scored by load, a warmed call left the engine it was warmed on two times in three in the simulator (one
request more running there outweighed a 200-token prefix), and computed its prefix twice.

An affinity key (OpenAI's ``prompt_cache_key``) pins work to the engine its key's first request went to, while
that engine is among the healthy ones offered and not overloaded (past the balance thresholds, or its KV cache
nearly full); otherwise the work is scored as any, and the key moves to where it went.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Callable, NamedTuple, Sequence, TypeVar

from gateway.config import SchedulerConfig
from gateway.engine_view import EngineView
from gateway.held_blocks import HeldBlocks
from gateway.prompt_prefix import TOKENS_PER_CHUNK

View = TypeVar("View", bound=EngineView)
_PASSED_OVER = 1e18  # added to the score of an engine past the balance thresholds: ranked, but last
_MAX_GROUPS = 100_000  # task groups (and affinity keys) remembered (the oldest forgotten first)
# How urgent work is, as one number (Placement.level): what an engine that orders its queue by a request's
# ``priority`` (vLLM, SGLang) is sent, through its PrioritizedEngine capability.
LATENCY_LEVEL, URGENT_GROUP_LEVEL, THROUGHPUT_LEVEL = 0, 1, 2


class Warmed(NamedTuple):
    """Where a call's prompt was prefilled ahead of its inputs (gateway/semantic/prefill.py), and how far."""

    engine: str
    tokens: int  # its prompt's tokens prefilled there (0: its full chunks)


class Placement(NamedTuple):
    """What a caller knows of a request's scheduling beyond its prompt."""

    latency: bool = True  # latency-critical (wants a seat now) or throughput (may wait for a big batch)
    group: str | None = None  # its task group: calls one consumer waits for, all of them
    held_by: frozenset[str] = frozenset()  # engines known to hold its whole prefix (a pinned context, a warmed one)
    # A member of a task group that someone waits on (its consumer is latency-critical): batched with its peers,
    # but ahead of throughput work.
    urgent: bool = False
    affinity: str | None = None  # an affinity key (OpenAI's prompt_cache_key): same key, same engine
    warmed: Warmed | None = None  # its prompt prefilled ahead there: it runs there unless a wait costs more

    @property
    def level(self) -> int:
        """LATENCY_LEVEL (someone waits on it alone), URGENT_GROUP_LEVEL (a task group someone waits on) or
        THROUGHPUT_LEVEL: lower is sooner."""
        if self.latency:
            return LATENCY_LEVEL
        return URGENT_GROUP_LEVEL if self.urgent else THROUGHPUT_LEVEL


class Work(NamedTuple):
    """What the scheduler knows of one request before it runs."""

    prefix: tuple[int, ...] = ()  # chain hashes of its prompt's full chunks (gateway/prompt_prefix.py)
    prompt_tokens: int = 0
    placement: Placement = Placement()
    prefix_tokens: int = 0  # what placement.held_by hold: its whole prefix, in tokens (0: its full chunks)
    # Its prompt's token ids, where an engine it may go to publishes KV events (empty: matched by ``prefix``).
    token_ids: tuple[int, ...] = ()


def _no_events(engine_id: str) -> HeldBlocks | None:
    return None


class Scheduler:
    def __init__(self, config: SchedulerConfig | None = None):
        self.config = config or SchedulerConfig()
        # engine → the prefix chunks it holds, LRU first, in two segments: chunks placed there once (mostly a
        # request's own tail) and chunks placed again (shared prefixes). The first are forgotten first, so
        # that a stream of one-off tails does not push a shared system prompt out of the mirror.
        self._once: dict[str, OrderedDict[int, None]] = {}
        self._again: dict[str, OrderedDict[int, None]] = {}
        self._holders: dict[int, set[str]] = {}  # prefix chunk → the engines holding it
        self._groups: OrderedDict[str, str] = OrderedDict()  # task group → the engine its first member went to
        self._affinity: OrderedDict[str, str] = OrderedDict()  # affinity key → the engine its work went to last
        self._turn = 0  # round-robin among equal scores
        # engine → the blocks its live KV events say it holds; None: no events (or not live), the mirror counts
        self.exact: Callable[[str], HeldBlocks | None] = _no_events

    def place(self, work: Work, views: Sequence[View]) -> View | None:
        """``best``, remembered as placed there; None if there is no view."""
        chosen = self.best(work, views)
        if chosen is not None:
            self.placed(work, chosen)
        return chosen

    def best(self, work: Work, views: Sequence[View]) -> View | None:
        """Of ``views`` (healthy engines of the request's model), where ``work`` should run; None if none."""
        if len(views) <= 1:
            return views[0] if views else None
        self._turn += 1
        if self.config.policy == "round_robin":
            return views[self._turn % len(views)]
        if self.config.policy == "least_loaded":
            scores = [view.load() for view in views]
        else:
            pinned = self._pinned(work.placement.affinity, views)
            if pinned is not None:
                return pinned
            scores = self._scores(work, views, self.held_tokens(work, views))
        low = min(scores)
        ties = [i for i, score in enumerate(scores) if score == low]
        return views[ties[self._turn % len(ties)]]

    def _pinned(self, key: str | None, views: Sequence[View]) -> View | None:
        """The engine ``key``'s work went to, when it is among ``views`` and not overloaded."""
        engine = self._affinity.get(key) if key is not None else None
        if engine is None:
            return None
        pinned = next((view for view in views if view.id == engine), None)
        if pinned is None or pinned.stats.kv_use() >= self.config.kv_full:
            return None
        floor = min(view.load() for view in views)
        load = pinned.load()
        if load - floor > self.config.balance_abs_threshold and load > floor * self.config.balance_ratio:
            return None
        return pinned

    def _scores(self, work: Work, views: Sequence[View], held: dict[str, int]) -> list[float]:
        config = self.config
        loads = [view.load() for view in views]
        floor = min(loads)
        placement = work.placement
        queue_cost = config.queue_tokens_per_request * (1.0 if placement.latency else config.throughput_queue_weight)
        group_engine = self._groups.get(placement.group) if placement.group is not None else None
        warmed = placement.warmed.engine if placement.warmed is not None else None
        scores = []
        for view, load in zip(views, loads):
            uncached = max(0, work.prompt_tokens - held.get(view.id, 0))
            queue = self._queued_beyond_next_step(view) if warmed is not None else load
            score = queue * queue_cost + uncached + self._evicted(view, uncached)
            if view.stats.kv_use() >= config.kv_full:
                score += work.prompt_tokens + config.queue_tokens_per_request
            if (warmed is None and load - floor > config.balance_abs_threshold
                    and load > floor * config.balance_ratio):
                score += _PASSED_OVER
            if view.id == warmed:
                score -= 1  # wins ties, before a group's engine: its prefill is there
            if view.id == group_engine:
                score -= 0.5  # wins ties: members batch together
            scores.append(score)
        return scores

    def _queued_beyond_next_step(self, view: EngineView) -> int:
        """Requests a newcomer on ``view``'s engine would wait behind: those waiting there beyond what its next
        step admits (a continuous batch takes the rest in at once)."""
        return max(0, view.waiting() - self.config.next_step_requests)

    def _evicted(self, view: EngineView, uncached: int) -> int:
        """Tokens others hold that computing ``uncached`` tokens on ``view``'s engine would evict, where its live
        KV events say how full its cache is (0 elsewhere): without it, a new prompt sharing one block with what
        a full engine holds went there rather than to an empty one, and evicted a prefix in use."""
        blocks = self.exact(view.id)
        capacity = view.stats.kv_capacity_tokens()
        if blocks is None or not capacity:
            return 0
        return max(0, uncached - (capacity - len(blocks) * blocks.block_size))

    def held_tokens(self, work: Work, views: Sequence[EngineView] = ()) -> dict[str, int]:
        """Engine → tokens of the work's prefix it holds: of ``views``, those with live KV events by them (the
        blocks of its token ids they hold), the others by the mirror (its longest run of the chain); at least
        what its placement says is held there (its whole prefix) or was warmed there."""
        held: dict[str, int] = {}
        told: set[str] = set()
        if work.token_ids:
            for view in views:
                blocks = self.exact(view.id)
                if blocks is not None:
                    told.add(view.id)
                    held[view.id] = blocks.held_tokens(work.token_ids)
        for i in range(len(work.prefix) - 1, -1, -1):
            for engine in self._holders.get(work.prefix[i], ()):
                if engine not in held and engine not in told:
                    held[engine] = (i + 1) * TOKENS_PER_CHUNK
        chunks = len(work.prefix) * TOKENS_PER_CHUNK
        known = {engine: work.prefix_tokens or chunks for engine in work.placement.held_by}
        warmed = work.placement.warmed
        if warmed is not None:
            known[warmed.engine] = max(known.get(warmed.engine, 0), warmed.tokens or chunks)
        for engine, tokens in known.items():
            held[engine] = max(held.get(engine, 0), tokens)
        return held

    def placed(self, work: Work, view: EngineView) -> None:
        """``work`` went to ``view``'s engine: it holds the work's prefix from now on."""
        once = self._once.setdefault(view.id, OrderedDict())
        again = self._again.setdefault(view.id, OrderedDict())
        for chunk in work.prefix:
            if chunk in again:
                again.move_to_end(chunk)
            elif chunk in once:
                del once[chunk]
                again[chunk] = None
            else:
                once[chunk] = None
                self._holders.setdefault(chunk, set()).add(view.id)
        capacity = view.stats.kv_capacity_tokens() or self.config.default_capacity_tokens
        while (len(once) + len(again)) * TOKENS_PER_CHUNK > capacity:
            self._drop(view.id, (once or again).popitem(last=False)[0])
        group = work.placement.group
        if group is not None and group not in self._groups:
            self._groups[group] = view.id
            if len(self._groups) > _MAX_GROUPS:
                self._groups.popitem(last=False)
        key = work.placement.affinity
        if key is not None:
            self._affinity[key] = view.id
            self._affinity.move_to_end(key)
            if len(self._affinity) > _MAX_GROUPS:
                self._affinity.popitem(last=False)

    def forget(self, engine_id: str) -> None:
        """An engine gone: nothing is held there any more."""
        for segment in (self._once, self._again):
            for chunk in segment.pop(engine_id, {}):
                self._drop(engine_id, chunk)
        for group in [g for g, engine in self._groups.items() if engine == engine_id]:
            del self._groups[group]
        for key in [k for k, engine in self._affinity.items() if engine == engine_id]:
            del self._affinity[key]

    def held_prefix_tokens(self, engine_id: str) -> int:
        """The prompt-prefix tokens the scheduler counts on that engine holding."""
        blocks = self.exact(engine_id)
        if blocks is not None:
            return len(blocks) * blocks.block_size
        return (len(self._once.get(engine_id, ())) + len(self._again.get(engine_id, ()))) * TOKENS_PER_CHUNK

    def _drop(self, engine_id: str, chunk: int) -> None:
        holders = self._holders.get(chunk)
        if holders is not None:
            holders.discard(engine_id)
            if not holders:
                del self._holders[chunk]
