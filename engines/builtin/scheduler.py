"""Continuous batching: decodes and chunked prefills share each step under a token budget.

Order of service: running sequences by priority (higher first, then arrival), then waiting
ones. When blocks run out, idle contexts lose their KV first (least recently used; their full
blocks stay in the prefix cache), then the lowest-priority running sequence is preempted by
recompute: its blocks are dropped and it goes back to waiting.

The batch also says which decodes share leading KV blocks (forks of one context, prefix-cache
hits on one system prompt), so attention can read each shared prefix once for its group.
"""

from __future__ import annotations

from engines.builtin.block_manager import BlockManager
from engines.builtin.config import EngineConfig
from engines.builtin.model_runner import PrefixGroup, ScheduledBatch
from engines.builtin.sequence import Sequence, Status, next_arrival


def service_order(seq: Sequence) -> tuple[int, int]:
    return (-seq.priority, seq.arrival)


def prefix_groups(decodes: list[Sequence], block_size: int) -> list[PrefixGroup]:
    """Groups of two or more decodes whose block tables start with the same blocks.

    The block manager shares only full blocks (by fork or prefix-cache hit), computed at the
    latest in this step before attention reads them, so equal leading block ids mean equal
    leading KV. Grouped by first block; a group's prefix is its members' longest common run of
    leading blocks.
    """
    by_first_block: dict[int, list[int]] = {}
    for i, seq in enumerate(decodes):
        if seq.num_computed_tokens >= block_size:
            by_first_block.setdefault(seq.block_table[0], []).append(i)
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


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager):
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.max_num_batched_tokens
        self.block_manager = block_manager
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self.contexts: dict[str, Sequence] = {}  # every live context, idle ones included
        self.num_preemptions = 0

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, seq: Sequence) -> None:
        seq.arrival = next_arrival()
        seq.status = Status.WAITING
        self.waiting.append(seq)

    def remove(self, seq: Sequence) -> None:
        """Detaches ``seq``'s request; the context itself stays (idle) unless temporary."""
        if seq in self.running:
            self.running.remove(seq)
        if seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = Status.IDLE

    def schedule(self) -> tuple[ScheduledBatch, list[Sequence]]:
        """Returns the step's batch and the waiting fills that turned out fully cached (done)."""
        budget = self.max_num_batched_tokens
        entries: list[tuple[Sequence, int]] = []
        self.running.sort(key=service_order)
        for seq in list(self.running):
            if seq.status is not Status.RUNNING or budget == 0:
                continue  # preempted below while making room for a higher-priority sequence
            n = min(seq.num_pending_tokens, budget)
            if not self._make_room(seq, n):
                self._preempt(seq)
                continue
            self.block_manager.allocate(seq, n)
            entries.append((seq, n))
            budget -= n
        done_fills = self._admit_waiting(entries, budget)
        entries.sort(key=lambda entry: entry[1] != 1)  # decodes first, as the runner expects
        decodes = [seq for seq, n in entries if n == 1]
        return ScheduledBatch(entries, prefix_groups(decodes, self.block_manager.block_size)), done_fills

    def _admit_waiting(self, entries: list[tuple[Sequence, int]], budget: int) -> list[Sequence]:
        done_fills = []
        self.waiting.sort(key=service_order)
        for seq in list(self.waiting):
            if budget == 0 or len(self.running) >= self.max_num_seqs:
                break
            self.block_manager.match_prefix(seq, self._reusable_tokens(seq))
            if seq.num_pending_tokens == 0:
                self.waiting.remove(seq)
                done_fills.append(seq)
                continue
            n = min(seq.num_pending_tokens, budget)
            if not self._make_room(seq, n, preempt_running=False):
                # Give back what matching took (full blocks stay cached): waiting sequences holding
                # blocks could starve the running ones.
                self.block_manager.release(seq)
                break
            self.block_manager.allocate(seq, n)
            self.waiting.remove(seq)
            self.running.append(seq)
            seq.status = Status.RUNNING
            entries.append((seq, n))
            budget -= n
        return done_fills

    @staticmethod
    def _reusable_tokens(seq: Sequence) -> int:
        """How many of ``seq``'s next tokens may come from the prefix cache instead of being computed."""
        if seq.score_top_k is not None:
            # A scoring fill needs every position's logits: only the positions already scored (before
            # it was preempted) may be reused. Scores are keyed by the token they score: p needs row p - 1.
            return max(seq.scores, default=0) - seq.num_computed_tokens
        # A generation must compute at least its last token to get logits.
        return seq.num_pending_tokens - (0 if seq.is_fill else 1)

    def _make_room(self, seq: Sequence, num_tokens: int, *, preempt_running: bool = True) -> bool:
        while not self.block_manager.can_allocate(seq, num_tokens):
            victim = self._idle_victim()
            if victim is None and preempt_running:
                victim = self._running_victim(seq)
            if victim is None:
                return False
            self._preempt(victim)
        return True

    def _idle_victim(self) -> Sequence | None:
        idle = [s for s in self.contexts.values() if s.status is Status.IDLE and s.block_table]
        return min(idle, key=lambda s: s.last_used) if idle else None

    def _running_victim(self, seq: Sequence) -> Sequence | None:
        """The last-served running sequence, if it is served after ``seq``."""
        candidates = [s for s in self.running if s.status is Status.RUNNING and s is not seq]
        if not candidates:
            return None
        victim = max(candidates, key=service_order)
        return victim if service_order(victim) > service_order(seq) else None

    def _preempt(self, seq: Sequence) -> None:
        self.block_manager.release(seq)
        if seq.status is Status.RUNNING:
            self.num_preemptions += 1
            self.running.remove(seq)
            seq.status = Status.WAITING
            self.waiting.append(seq)
