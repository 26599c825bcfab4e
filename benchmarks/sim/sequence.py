"""One request on a simulated engine: its prompt, how many tokens it generates, and how far it has got."""

from __future__ import annotations

from typing import Callable, Sequence as Seq

from benchmarks.sim.prompt import Piece, tokens


class Sequence:
    __slots__ = ("name", "pieces", "prompt_tokens", "output_tokens", "level", "on_done", "on_first_token",
                 "arrived", "chain", "computed", "generated", "held", "private", "hit_tokens", "first_token_at")

    def __init__(self, name: str, pieces: Seq[Piece], output_tokens: int, *, level: int = 0,
                 on_done: Callable[["Sequence"], None] | None = None):
        self.name = name
        self.pieces = tuple(pieces)
        self.prompt_tokens = tokens(self.pieces)
        self.output_tokens = output_tokens  # a prefill-only request generates 1
        self.level = level  # its priority: lower runs sooner on an engine that orders by priority
        self.on_done = on_done
        self.arrived = 0.0
        self.chain: tuple[int, ...] = ()  # block hashes of prompt + output, the engine's block size
        self.computed = 0  # prompt tokens computed (or found cached)
        self.generated = 0
        self.held = 0  # of its chain's first blocks, those in the cache under its name
        self.private = 0  # its other reserved blocks
        self.hit_tokens = 0
        self.first_token_at: float | None = None

    @property
    def decoding(self) -> bool:
        return self.computed >= self.prompt_tokens

    @property
    def remaining(self) -> int:
        return self.output_tokens - self.generated
