"""A paged KV cache with automatic prefix caching, as vLLM keeps one: blocks of ``block_size`` tokens, each full
block of a sequence named by the chain hash of every token up to its end; a new request reuses the longest run of
its prompt's blocks found here. Blocks that running sequences use are held; a released block stays cached, and the
least recently released is evicted when a new block needs room. Tokens are never stored, only block names and
counts: the simulator needs what is computed and what is not, and how much room is left."""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable, Sequence


class PrefixCache:
    def __init__(self, blocks: int):
        self.capacity = blocks
        self._refs: dict[int, int] = {}  # cached block → running sequences using it
        self._idle: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody uses, least recently released first
        self.private = 0  # blocks held by running sequences that are not (yet) cached: their partial and new blocks
        self.queries = 0  # prompt tokens looked up, and of those found (vLLM's prefix_cache_queries / hits)
        self.hits = 0

    def used(self) -> int:
        return len(self._refs) + self.private

    def free(self) -> int:
        """Blocks a new sequence may take: empty ones and idle cached ones (evicted as needed)."""
        return self.capacity - self.used() + len(self._idle)

    def longest_run(self, chain: Sequence[int]) -> int:
        """How many of ``chain``'s first blocks are cached."""
        for i, block in enumerate(chain):
            if block not in self._refs:
                return i
        return len(chain)

    def acquire(self, chain: Iterable[int]) -> None:
        """Cached blocks taken into use by a running sequence."""
        for block in chain:
            self._refs[block] += 1
            self._idle.pop(block, None)

    def reserve(self, blocks: int) -> bool:
        """Room for ``blocks`` new blocks, evicting idle cached ones; False (nothing taken) when there is none."""
        if blocks > self.free():
            return False
        while self.capacity - self.used() < blocks:
            self._evict()
        self.private += blocks
        return True

    def store(self, block: int) -> None:
        """One of a running sequence's reserved blocks, now full, cached under its name (another sequence may
        have computed the same block meanwhile: then it is shared and the reserved one freed)."""
        self.private -= 1
        if block in self._refs:
            self._refs[block] += 1
            self._idle.pop(block, None)
        else:
            self._refs[block] = 1

    def release(self, chain: Iterable[int], private: int) -> None:
        """A sequence done: its cached blocks idle (most recently used last), its other blocks freed."""
        for block in chain:
            self._refs[block] -= 1
            if self._refs[block] == 0:
                self._idle[block] = None
                self._idle.move_to_end(block)
        self.private -= private

    def _evict(self) -> None:
        block, _ = self._idle.popitem(last=False)
        del self._refs[block]
