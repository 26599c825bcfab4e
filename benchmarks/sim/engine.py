"""A simulated continuous-batching engine, vLLM's V1 scheduler in outline: each step first gives every running
sequence its due (one token to each decoding one, the next prompt chunk to each still prefilling), then admits
waiting requests (first come first served, or by priority) while the step's token budget, the seats
(max sequences) and the KV cache allow; a request's prompt is looked up in the prefix cache on admission and only
the rest computed, in chunks. The step takes ``StepCost.seconds`` of its prompt tokens and decoding sequences.

Steps where nothing but decoding happens are run as one event up to the first sequence's end (they all cost the
same); a request arriving meanwhile cuts the run short at the end of the step in flight. So the clock advances
per change, not per token, and a fleet of engines simulates in seconds.
"""

from __future__ import annotations

import math

from benchmarks.sim.clock import Clock
from benchmarks.sim.prefix_cache import PrefixCache
from benchmarks.sim.prompt import chain
from benchmarks.sim.sequence import Sequence
from benchmarks.sim.step_cost import EngineShape, StepCost, chunk_pairs
from engines.seam import EngineStats

Plan = list[tuple[Sequence, int]]  # the step's sequences and the prompt tokens each computes (0: decodes one)


class SimEngine:
    def __init__(self, name: str, clock: Clock, cost: StepCost, shape: EngineShape):
        self.name = name
        self.clock = clock
        self.cost = cost
        self.shape = shape
        self.cache = PrefixCache(shape.kv_blocks)
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.busy_s = 0.0  # time spent in steps
        self.computed_tokens = 0  # prompt tokens computed (not found cached)
        self.steps = 0
        self.decode_steps = 0  # decoding sequences × steps: what the per-sequence cost was paid for
        self._busy = False
        self._front_free_at = 0.0
        self._stated: tuple = ()
        self._stats = EngineStats()
        self._in_front = 0  # requests in the API front end
        self._ending = False  # in a step's end: requests submitted now join the next step
        self._epoch = 0  # a step end scheduled under an older epoch was cut short and is ignored
        # a decode run in flight: its start, first step's seconds, each next step's more, steps, plan
        self._run: tuple[float, float, float, int, Plan] | None = None

    # ------------------------------------------------------------ outside

    def submit(self, seq: Sequence) -> None:
        """A request reaches the server: its API front end takes ``request_s`` of it (one at a time), then it
        waits for the engine's next step."""
        seq.arrived = self.clock.now
        seq.chain = chain(seq.pieces + ((f"out:{seq.name}", seq.output_tokens),), self.shape.block_size)
        if self.cost.request_s <= 0:
            self._enqueue(seq)
            return
        self._front_free_at = max(self.clock.now, self._front_free_at) + self.cost.request_s
        self._in_front += 1
        self.clock.at(self._front_free_at, lambda: self._enqueue(seq, from_front=True))

    def _enqueue(self, seq: Sequence, from_front: bool = False) -> None:
        self._in_front -= from_front
        self.waiting.append(seq)
        if self._ending:
            return
        if not self._busy:
            self._step()
        elif self._run is not None:
            self._cut_run()

    def load(self) -> int:
        return len(self.running) + len(self.waiting) + self._in_front

    def stats(self) -> EngineStats:
        """What it would report on /metrics now (rebuilt only when something changed since it was last asked)."""
        state = (len(self.running), len(self.waiting), self._in_front, self.cache.used(), self.cache.queries)
        if state != self._stated:
            self._stated, self._stats = state, self._read_stats()
        return self._stats

    def _read_stats(self) -> EngineStats:
        return EngineStats(running=len(self.running), waiting=len(self.waiting) + self._in_front,
                           blocks_total=self.shape.kv_blocks,
                           blocks_free=max(0, min(self.shape.kv_blocks, self.cache.free())),
                           block_size=self.shape.block_size, prefix_cache_queries=self.cache.queries,
                           prefix_cache_hits=self.cache.hits)

    # ------------------------------------------------------------ steps

    def _step(self) -> None:
        plan = self._plan()
        if not plan:
            self._busy = False
            return
        self._busy = True
        prefill, decoding, pairs = self._work(plan)
        seconds = self.cost.seconds(prefill, decoding, pairs)
        if prefill:
            self._end_at(self.clock.now + seconds, plan, 1)
            return
        # decode only: every step alike but for one more key per sequence, until the first sequence ends
        growth = self.cost.attention_pair_s * decoding
        steps = min(seq.remaining for seq, _ in plan)
        self._run = (self.clock.now, seconds, growth, steps, plan)
        self._end_at(self.clock.now + _run_seconds(seconds, growth, steps), plan, steps)

    def _work(self, plan: Plan) -> tuple[int, int, float]:
        """A step's prompt tokens, decoding sequences and attention pairs."""
        prefill = decoding = 0
        pairs = 0.0
        for seq, chunk in plan:
            if chunk:
                prefill += chunk
                pairs += chunk_pairs(seq.computed, chunk)
            else:
                decoding += 1
                pairs += seq.prompt_tokens + seq.generated
        return prefill, decoding, pairs

    def _end_at(self, when: float, plan: Plan, steps: int) -> None:
        epoch = self._epoch

        def end() -> None:
            if epoch == self._epoch:
                self._end(plan, steps, when)
        self.clock.at(when, end)

    def _cut_run(self) -> None:
        """A request arrived during a decode run: the run stops at the end of the step in flight."""
        start, seconds, growth, steps, plan = self._run  # type: ignore[misc]
        elapsed = self.clock.now - start
        if seconds <= 0:
            return  # steps that take no time (a basis of the calibration's fit) end where they begin
        if growth == 0:
            done = max(1, math.ceil(elapsed / seconds - 1e-9))
        else:  # the least d with d·seconds + growth·d(d-1)/2 ≥ elapsed
            b = seconds - growth / 2
            done = max(1, math.ceil((-b + math.sqrt(b * b + 2 * growth * elapsed)) / growth - 1e-9))
        if done < steps:
            self._epoch += 1
            self._run = None
            self._end_at(start + _run_seconds(seconds, growth, done), plan, done)

    def _plan(self) -> Plan:
        budget = self.shape.max_batched_tokens
        plan: Plan = []
        for seq in self.running:
            if budget <= 0:
                break
            chunk = 0 if seq.decoding else min(seq.prompt_tokens - seq.computed, budget)
            plan.append((seq, chunk))
            budget -= max(chunk, 1)
        if self.shape.priority:
            self.waiting.sort(key=lambda s: s.level)  # stable: first come first within a level
        while self.waiting and budget > 0 and len(self.running) < self.shape.max_seqs:
            seq = self.waiting[0]
            if not self._admit(seq):
                break
            self.waiting.pop(0)
            self.running.append(seq)
            chunk = min(seq.prompt_tokens - seq.computed, budget)
            plan.append((seq, chunk))
            budget -= chunk
        return plan

    def _admit(self, seq: Sequence) -> bool:
        """Its prompt looked up in the prefix cache (full blocks, the last prompt token always computed) and room
        reserved for the rest of it and its output; False when the KV cache has no room."""
        size = self.shape.block_size
        hit = self.cache.longest_run(seq.chain[: (seq.prompt_tokens - 1) // size])
        needed = -(-(seq.prompt_tokens + seq.output_tokens) // size) - hit
        if not self.cache.reserve(needed):
            return False
        self.cache.acquire(seq.chain[:hit])
        seq.held, seq.private = hit, needed
        seq.computed = seq.hit_tokens = hit * size
        self.cache.queries += seq.prompt_tokens
        self.cache.hits += seq.hit_tokens
        return True

    def _end(self, plan: Plan, steps: int, when: float) -> None:
        self._run = None
        self._ending = True
        prefill, decoding, pairs = self._work(plan)
        self.busy_s += _run_seconds(self.cost.seconds(prefill, decoding, pairs),
                                    self.cost.attention_pair_s * decoding, steps)
        self.computed_tokens += prefill
        self.steps += steps
        self.decode_steps += decoding * steps
        done: list[Sequence] = []
        for seq, tokens in plan:
            if tokens:
                seq.computed += tokens
                if seq.decoding:
                    seq.generated += 1
                    seq.first_token_at = when
            else:
                seq.generated += steps
            self._store(seq)
            if seq.remaining <= 0:
                done.append(seq)
        for seq in done:
            self.running.remove(seq)
            self.cache.release(seq.chain[: seq.held], seq.private)
        for seq in done:
            if seq.on_done is not None:
                seq.on_done(seq)
        self._ending = False
        self._step()

    def _store(self, seq: Sequence) -> None:
        """The sequence's blocks whose every token's KV is computed now, cached under their names."""
        ready = min(len(seq.chain), (seq.computed + max(0, seq.generated - 1)) // self.shape.block_size)
        while seq.held < ready:
            self.cache.store(seq.chain[seq.held])
            seq.held += 1
            seq.private -= 1


def _run_seconds(first: float, growth: float, steps: int) -> float:
    """Seconds of ``steps`` decode steps, the first taking ``first`` and each the next ``growth`` more."""
    return steps * first + growth * steps * (steps - 1) / 2
