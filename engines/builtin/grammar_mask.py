"""Constrained decoding, each step: a context's position in its grammar, and the logits it forbids.

A constrained context carries a ``GrammarMatcher``; each step the sampler masks its logits row to the
tokens the grammar allows, then advances the matcher by the sampled token. Once the grammar can take
nothing more the context ends with "stop". Unconstrained contexts carry nothing and the sampler never
looks at them.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

log = logging.getLogger(__name__)


class GrammarMatcher:
    """One sequence's position in its grammar."""

    def __init__(self, matcher: Any, vocab_size: int):
        self.matcher = matcher
        self.vocab_size = vocab_size

    @property
    def finished(self) -> bool:
        """Nothing more can follow (or the matcher failed, which masking should make impossible)."""
        return self.matcher.is_stopped()

    def advance(self, token_id: int) -> None:
        if not self.matcher.consume_token(token_id):
            log.warning("grammar rejected token %d: %s", token_id, self.matcher.get_error())


def mask_logits(logits: torch.Tensor, grammars: Sequence[tuple[int, GrammarMatcher]]) -> None:
    """Sets to -inf, in place, the logits of the tokens each constrained row's grammar forbids.

    logits: [batch, vocab]; grammars: (row, matcher) for the constrained rows only.
    """
    rows = [row for row, _ in grammars]
    words = (grammars[0][1].vocab_size + 31) // 32
    bitmask = torch.empty(len(rows), words, dtype=torch.int32)  # [constrained, words]: token t is bit t%32 of word t//32
    for k, (_, grammar) in enumerate(grammars):
        grammar.matcher.unsafe_compute_mask_ptr(bitmask[k].data_ptr(), words * 4)
    bits = (bitmask.unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1  # [constrained, words, 32]
    allowed = bits.reshape(len(rows), words * 32).bool()
    vocab = logits.shape[1]
    if allowed.shape[1] < vocab:  # model rows past the tokenizer's vocabulary are never valid
        allowed = torch.nn.functional.pad(allowed, (0, vocab - allowed.shape[1]))
    forbidden = ~allowed[:, :vocab].to(logits.device, non_blocking=True)
    for k, row in enumerate(rows):  # in place on each row: no gather/scatter of the whole batch
        logits[row].masked_fill_(forbidden[k], float("-inf"))
