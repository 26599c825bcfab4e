"""What one engine's prefix cache holds, exactly, as its KV-cache events (gateway/kv_events.py) told it: full blocks
of tokens, each named by the gateway's own chain hash over the token ids, so that a prompt's token ids are matched
against it block by block without vLLM's hash seed or algorithm.

An event names blocks by the engine's hashes; a block's chain hash here is ``hash((its parent's, its tokens,
its extra keys))``, its parent found by the engine's ``parent_block_hash``. A block whose parent is not known here
(its store was missed) cannot be placed in a chain and is left out, with every block after it in that event. A
block stored with extra keys (a LoRA, a cache salt, multimodal inputs) gets a chain of its own that a plain
prompt's tokens never match, as in the engine. Only the accelerator's tier counts (``medium`` "GPU", or none):
what was offloaded to CPU or storage is not a hit at prefill.

Pure data: the consumer applies events, the scheduler reads ``held_tokens``; no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter
from typing import Any, Callable, Iterable, Sequence

from engines.seam.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

_ROOT = 0
_FAST_TIER = (None, "GPU")


def chain_hashes(token_ids: Sequence[int], block_size: int, root: int = _ROOT) -> list[int]:
    """The chain hashes of ``token_ids``' full blocks."""
    hashes = []
    previous = root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size]), None))
        hashes.append(previous)
    return hashes


class HeldBlocks:
    def __init__(self) -> None:
        self.block_size = 0  # tokens per block, from the events (0: no block stored yet)
        self._ours: dict[BlockHash, int] = {}  # the engine's block hash -> our chain hash
        self._held: Counter[int] = Counter()  # our chain hash -> engine blocks holding it (several with extra keys)
        self._watchers: list[Callable[[set[int]], None]] = []

    def __len__(self) -> int:
        return len(self._held)

    def on_removed(self, watcher: Callable[[set[int]], None]) -> Callable[[], None]:
        """``watcher(chain hashes)`` after each batch of events that took blocks out of the cache; returns the
        function that stops it."""
        self._watchers.append(watcher)
        return lambda: self._watchers.remove(watcher) if watcher in self._watchers else None

    def apply(self, events: Iterable[KVEvent]) -> None:
        removed: set[int] = set()
        for event in events:
            if isinstance(event, BlockStored):
                self._store(event)
            elif isinstance(event, BlockRemoved):
                removed |= self._remove(event)
            elif isinstance(event, AllBlocksCleared):
                removed |= set(self._held)
                self.clear()
        if removed:
            gone = {h for h in removed if h not in self._held}
            for watcher in list(self._watchers):
                watcher(gone)

    def clear(self) -> None:
        """Nothing is known to be held (the engine cleared its cache, or events were lost: what it holds now is
        learnt again from the next events)."""
        self._ours.clear()
        self._held.clear()

    def held_tokens(self, token_ids: Sequence[int]) -> int:
        """Tokens of ``token_ids``' prefix held in full blocks here."""
        return self.held_blocks(chain_hashes(token_ids, self.block_size)) * self.block_size if self.block_size else 0

    def held_blocks(self, chain: Sequence[int]) -> int:
        """How many of ``chain``'s first hashes are held (the longest held run from its start)."""
        held = 0
        for h in chain:
            if h not in self._held:
                break
            held += 1
        return held

    def _store(self, event: BlockStored) -> None:
        if event.medium not in _FAST_TIER or event.block_size <= 0:
            return
        if event.parent_block_hash is None:
            previous = _ROOT
        elif event.parent_block_hash in self._ours:
            previous = self._ours[event.parent_block_hash]
        else:
            return  # its parent's store was missed: no chain to place it in
        self.block_size = event.block_size
        size = event.block_size
        for i, engine_hash in enumerate(event.block_hashes):
            tokens = tuple(event.token_ids[i * size:(i + 1) * size])
            if len(tokens) < size:
                return
            previous = hash((previous, tokens, _extra(event, i)))
            if engine_hash in self._ours:  # stored again: the same block, nothing new held
                continue
            self._ours[engine_hash] = previous
            self._held[previous] += 1

    def _remove(self, event: BlockRemoved) -> set[int]:
        if event.medium not in _FAST_TIER:
            return set()
        removed = set()
        for engine_hash in event.block_hashes:
            ours = self._ours.pop(engine_hash, None)
            if ours is None:
                continue
            self._held[ours] -= 1
            if self._held[ours] <= 0:
                del self._held[ours]
            removed.add(ours)
        return removed


def _extra(event: BlockStored, i: int) -> Any:
    """What beside its tokens keys block ``i`` in the engine (None for a plain prompt's block)."""
    extra = event.extra_keys[i] if event.extra_keys and i < len(event.extra_keys) else None
    if event.lora_name is not None or event.lora_id is not None:
        return (event.lora_name, event.lora_id, _hashable(extra))
    return _hashable(extra)


def _hashable(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(_hashable(v) for v in value)
    return value
