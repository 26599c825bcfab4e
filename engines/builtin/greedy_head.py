"""An all-greedy step's tokens from the output head's int8 screen, without the whole head's logits.

Why: a one-sequence fp32 decode step of SmolLM2 reads its 113 MB tied head (a fifth of the step's weights) to take
one argmax. kernels/native/greedy_head.cpp reads a 28 MB int8 copy of the head instead, bounds how far each
vocabulary row's logit can be from its approximation, and computes exactly only the rows that could be the largest
(a few blocks of 32), with the head's own kernel: the token is the one the full head's logits and argmax give, bit
for bit the same logits compared. Only for steps whose every sampled row is greedy with nothing else to compute
from the logits (no logprobs, penalties, biases, grammars, scored prompt rows), and for few rows, where the head's
reads bound its time (up to 16 rows in fp32, 4 in bf16, whose head is half the bytes).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from engines.builtin.context import Context
from engines.builtin import screen_cache
from engines.builtin.cpu_linear import NativeLinear
from engines.builtin.model import CausalLM
from engines.builtin.sampler import takes_argmax
from kernels import native

# The most rows a step screens, by the head's dtype: up to these the screen took clearly less time than the full head
# and its argmax (SmolLM2's head read from DRAM, on the hidden states of its own greedy steps); bf16's head, half the
# bytes, gains less and for fewer rows. The figures: docs/engine.md, "Measurements behind design choices".
SCREENED_ROWS = {torch.float32: 16, torch.bfloat16: 4}


class GreedyHead:
    """Called with the last layer's hidden states of the sampled rows and their sequences: their greedy tokens, or
    None where the screen does not answer (the caller takes the full head's logits then)."""

    def __init__(self, head_input: Callable[[torch.Tensor], torch.Tensor], head: NativeLinear,
                 kernels: native.NativeKernels):
        self.head_input, self.packed, self.kernels = head_input, head.packed, kernels
        self.screen = screen_cache.head_screen(head.packed)
        self.max_rows = min(SCREENED_ROWS.get(head.packed.dtype, 0), native.MAX_SCREENED_ROWS)

    @classmethod
    def of(cls, model: CausalLM) -> GreedyHead | None:
        """The model's greedy head where its head is on the native kernel (unquantized, bias-free), else None."""
        head, kernels = model.lm_head, native.library()
        if kernels is None or type(head) is not NativeLinear or head.bias is not None:
            return None
        made = cls(model.head_input, head, kernels)
        return made if made.screen is not None and made.max_rows else None

    def __call__(self, hidden: torch.Tensor, seqs: list[Context]) -> list[int] | None:
        if len(seqs) > self.max_rows or not takes_argmax(seqs):
            return None
        return self.kernels.screened_argmax(self.head_input(hidden).contiguous(), self.packed, self.screen)
