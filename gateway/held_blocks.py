"""What one engine's prefix cache holds, exactly, as its KV-cache events (gateway/kv_events.py) told it: full blocks
of tokens, each named by the gateway's own chain hash over the token ids, so that a prompt's token ids are matched
against it block by block without vLLM's hash seed or algorithm.

An event names blocks by the engine's hashes; a block's chain hash here is ``hash((its parent's, its tokens,
its extra keys))``, its parent found by the engine's ``parent_block_hash``. A block whose parent is not known here
(its store was missed: the consumer joined after it, or lost track) is placed by the prompts recently sent to the
engine (``placed``): one whose full blocks contain the event's first block after k others names the parent's chain,
and those k blocks are then known held too (the engine chained onto them), tied to the parent's hash: its removal
takes them out as well (a prefix's head outlives its tail in the engines' LRU; if not, under-knowing costs a miss).
Without such a prompt the block is left out, with every block after it in that event. (A hot prefix stored once
and hit ever since is never stored again: without this a late consumer would never place anything under it.) A
block stored with extra keys (a LoRA, a cache salt, multimodal inputs) gets a chain of its own that a plain
prompt's tokens never match, as in the engine. Only the accelerator's tier counts (``medium`` "GPU", or none):
what was offloaded to CPU or storage is not a hit at prefill.

Pure data: the consumer applies events, the scheduler reads ``held_tokens``; no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter, deque
from typing import Any, Callable, Iterable, Sequence

from engines.seam.kv_events import AllBlocksCleared, BlockHash, BlockRemoved, BlockStored, KVEvent

_ROOT = 0
_RECENT_PROMPTS = 256
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
        self._inferred: dict[BlockHash, list[int]] = {}  # a parent's engine hash -> the ancestors known through it
        self._recent: deque[tuple[int, ...]] = deque(maxlen=_RECENT_PROMPTS)  # prompts sent there, newest last

    def placed(self, token_ids: Sequence[int]) -> None:
        """A prompt of these token ids was sent to the engine (what places a block whose parent was missed)."""
        self._recent.append(tuple(token_ids))

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
        self._inferred.clear()

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
            ancestors = self._ancestors(event)
            if not ancestors:
                return  # its parent's store was missed, and no prompt sent there places it
            previous = ancestors[-1]
            self._ours[event.parent_block_hash] = previous
            self._inferred[event.parent_block_hash] = ancestors[:-1]
            for h in ancestors:
                self._held[h] += 1
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
            for h in [*self._inferred.pop(engine_hash, ()), ours]:
                self._held[h] -= 1
                if self._held[h] <= 0:
                    del self._held[h]
                removed.add(h)
        return removed

    def _ancestors(self, event: BlockStored) -> list[int]:
        """The chain hashes of the blocks before ``event``'s first, from a prompt recently sent to the engine that
        has that block at a block boundary after them (empty: none has it, or the event's blocks have extra keys)."""
        size = event.block_size
        first = tuple(event.token_ids[:size])
        if len(first) < size or event.extra_keys or event.lora_name is not None or event.lora_id is not None:
            return []
        for tokens in reversed(self._recent):
            for k in range(1, len(tokens) // size):
                if tokens[k * size:(k + 1) * size] == first:
                    return chain_hashes(tokens[:k * size], size)
        return []


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
