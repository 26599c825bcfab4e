"""A prompt as the simulator sees it: pieces of text by name and length in tokens (equal names, equal text), and
the chain hashes that name its full blocks, for an engine's prefix cache and for the gateway's scheduler alike."""

from __future__ import annotations

from typing import Sequence

Piece = tuple[str, int]  # (the text's name, its tokens)


def tokens(pieces: Sequence[Piece]) -> int:
    return sum(count for _, count in pieces)


def chain(pieces: Sequence[Piece], size: int) -> tuple[int, ...]:
    """The hash of each full ``size``-token block of ``pieces``: of the block before it and of the (name, token
    range) parts inside it, so that two prompts share a block exactly when they agree on every token up to its end."""
    hashes: list[int] = []
    previous, parts, filled = 0, [], 0
    for name, count in pieces:
        start = 0
        while start < count:
            take = min(count - start, size - filled)
            parts.append((name, start, start + take))
            filled += take
            start += take
            if filled == size:
                previous = hash((previous, tuple(parts)))
                hashes.append(previous)
                parts, filled = [], 0
    return tuple(hashes)
