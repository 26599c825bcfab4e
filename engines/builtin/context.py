"""A context: a token sequence with its KV blocks, living across fill and generate calls.

Parrot keeps contexts after a call ends so that later calls (or forked children) reuse their
KV. At most one request (a fill or a generation) is attached to a context at a time; the
request's bookkeeping lives on the context itself so the scheduler handles one object.
"""

from __future__ import annotations

import itertools
from enum import Enum, auto
from typing import Callable

import torch

from engines.builtin.types import SamplingParams, TokenScore

_arrival = itertools.count()


def next_arrival() -> int:
    return next(_arrival)


class Status(Enum):
    IDLE = auto()  # no request attached; may still hold KV blocks
    WAITING = auto()  # request queued, no step scheduled yet (or preempted)
    RUNNING = auto()


class Context:
    def __init__(self, context_id: str, token_ids: list[int], *, temporary: bool = False):
        self.context_id = context_id
        self.token_ids = list(token_ids)
        self.num_computed_tokens = 0  # leading tokens whose KV sits in block_table
        self.block_table: list[int] = []
        self.status = Status.IDLE
        self.temporary = temporary  # freed as soon as its one request ends
        # A temporary one kept when its generation finishes (stop or length), holding its prompt and output: a
        # gateway continues a conversation from it (an aborted or failed one is freed as any temporary one).
        self.kept_when_finished = False
        self.last_used = 0  # engine step of last activity, to evict idle contexts LRU
        self.num_released_blocks = 0  # set when the context is freed
        self.on_released: Callable[[int], None] | None = None  # told when it is (engine thread)
        self.clear_request()

    def clear_request(self) -> None:
        self.params: SamplingParams | None = None  # None: a fill (prefill only)
        self.arrival = next_arrival()  # FIFO order among equal priorities; also names the request
        self.num_prompt_tokens = 0  # tokens before this request's generation began
        self.generator: torch.Generator | None = None
        self.grammar = None  # a grammar.GrammarMatcher when the output is constrained
        # Called on the engine thread with each result; the engine wires it to an asyncio loop.
        self.deliver: Callable[[object], None] | None = None
        self.aborted = False
        self.num_computed_by_request = 0  # tokens this request computed (the rest were reused)
        # A scoring fill: each prompt token's logprob (and this many alternatives) by position.
        # Its every position is computed (no prefix-cache reuse: cached KV has no logits).
        self.score_top_k: int | None = None
        self.scores: dict[int, TokenScore] = {}
        self.fill_priority = 0  # a fill's place in line (a generation's is in its params)
        # A fill nobody waits for (a gateway pinning a shared prefix ahead of its use): it runs only in steps
        # without latency-critical work, so that no one's admitted request waits behind it (scheduler.py).
        self.background = False
        # Its latencies (time.perf_counter()): queued, first scheduled, last token generated.
        self.arrived_at = 0.0
        self.scheduled_at: float | None = None
        self.last_token_at = 0.0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def priority(self) -> int:
        return self.params.priority if self.params else self.fill_priority

    @property
    def latency_critical(self) -> bool:
        """A generation someone reads token by token; fills and throughput work are not."""
        return self.params is not None and not self.params.throughput

    @property
    def num_pending_tokens(self) -> int:
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def num_generated_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_fill(self) -> bool:
        return self.params is None

    def generated_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]
