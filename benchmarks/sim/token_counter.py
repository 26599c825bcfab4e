"""Prompt lengths in SmolLM2's tokens, the apps' own text rendered as its chat template does (ChatML): what the
CPU runs computed. The GPU predictions reuse the same lengths (Llama 3's tokenizer gives a little fewer tokens
for English text; the apps' shapes, not their exact lengths, are what the fleet predictions are about)."""

from __future__ import annotations

import functools
from pathlib import Path

TOKENS_PER_WORD = 1.45  # SmolLM2 on the workloads' English, if its tokenizer is not installed


@functools.lru_cache(maxsize=1)
def _tokenizer():
    # The engine's cached conversion of the shipped model (engines.builtin.loader.cached_source, not imported: it
    # loads torch); without it, lengths are counted by words.
    found = sorted(Path.home().glob(".cache/parrot/SmolLM2-135M-Instruct*/tokenizer.json"))
    if not found:
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(found[0]))


@functools.lru_cache(maxsize=65_536)
def count(text: str) -> int:
    tokenizer = _tokenizer()
    if tokenizer is None:
        return max(1, round(len(text.split()) * TOKENS_PER_WORD)) if text else 0
    return len(tokenizer.encode(text, add_special_tokens=False).ids)
