"""Next-token selection for a batch of sequences, vectorised over the batch.

A batch that is all greedy, without penalties, biases, grammars or logprobs takes one argmax.
Otherwise: logit bias -> penalties -> grammar mask -> (logprobs of that distribution) ->
temperature -> top-k / top-p / min-p -> a draw per row, from the sequence's own seeded generator
when it has a seed, so that a seeded request repeats itself whatever else shares its batch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from engines.builtin.grammar_mask import mask_logits
from engines.builtin.context import Context
from engines.builtin.types import SamplingParams, TokenScore


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float] | None = None
    top_logprobs: list[list[tuple[int, float]]] | None = None


def needs_full_path(params: SamplingParams) -> bool:
    return (
        not params.greedy
        or params.presence_penalty != 0.0
        or params.frequency_penalty != 0.0
        or params.repetition_penalty != 1.0
        or bool(params.logit_bias)
        or params.logprobs
        or params.grammar is not None
    )


def takes_argmax(seqs: list[Context]) -> bool:
    """Whether a batch's tokens are its rows' argmax, nothing else computed from the logits (the greedy fast path)."""
    return not any(needs_full_path(ctx.params) for ctx in seqs)


# Each row's argmax of [batch, vocab] fp32 logits as torch.argmax(dim=-1) answers it, or None where it does not
# take those logits.
RowArgmax = Callable[[torch.Tensor], "list[int] | None"]


class Sampler:
    def __init__(self, seed: int, row_argmax: RowArgmax | None = None):
        """``row_argmax``: the all-greedy batch's argmax (kernels/native.py's, a fraction of torch's CPU argmax's
        time, which was a visible share of a batched decode step); torch's where it is None."""
        self.generator = torch.Generator().manual_seed(seed)  # for rows without a seed of their own
        self.row_argmax = row_argmax

    def __call__(self, logits: torch.Tensor, seqs: list[Context]) -> SampleResult:
        # logits: [batch, vocab] float32, row i for seqs[i]
        if takes_argmax(seqs):
            tokens = self.row_argmax(logits) if self.row_argmax is not None else None
            return SampleResult(tokens if tokens is not None else logits.argmax(dim=-1).tolist())
        params = [ctx.params for ctx in seqs]
        logits = logits.clone()
        apply_logit_bias(logits, params)
        apply_penalties(logits, seqs)
        grammars = [(i, ctx.grammar) for i, ctx in enumerate(seqs) if ctx.grammar is not None]
        if grammars:
            mask_logits(logits, grammars)
        logprobs = torch.log_softmax(logits, dim=-1) if any(p.logprobs for p in params) else None
        greedy = torch.tensor([p.greedy for p in params])
        token_ids = torch.where(greedy, logits.argmax(dim=-1), self._draw(logits, seqs, params))
        result = self._result(token_ids, logprobs, params)
        for i, grammar in grammars:
            grammar.advance(result.token_ids[i])
        return result

    def _draw(self, logits: torch.Tensor, seqs: list[Context], params: list[SamplingParams]) -> torch.Tensor:
        temperature = torch.tensor([p.temperature if not p.greedy else 1.0 for p in params]).unsqueeze(1)
        probs = torch.softmax(logits / temperature, dim=-1)
        probs = filter_top_k_top_p_min_p(probs, params)
        # Exponential race (argmax p/q, q ~ Exp(1)) equals a multinomial draw and lets each row
        # use its own generator without a per-row multinomial.
        noise = torch.empty_like(probs)
        unseeded = [i for i, ctx in enumerate(seqs) if ctx.generator is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), probs.shape[1]).exponential_(generator=self.generator)
        for i, ctx in enumerate(seqs):
            if ctx.generator is not None:
                noise[i].exponential_(generator=ctx.generator)
        return (probs / noise).argmax(dim=-1)

    @staticmethod
    def _result(token_ids: torch.Tensor, logprobs: torch.Tensor | None, params: list[SamplingParams]) -> SampleResult:
        result = SampleResult(token_ids.tolist())
        if logprobs is None:
            return result
        chosen = logprobs.gather(1, token_ids.unsqueeze(1)).squeeze(1).tolist()
        k = max(p.top_logprobs for p in params)
        top_values, top_ids = logprobs.topk(max(k, 1), dim=-1)
        top_values, top_ids = top_values.tolist(), top_ids.tolist()
        result.logprobs = [chosen[i] if p.logprobs else None for i, p in enumerate(params)]
        result.top_logprobs = [
            list(zip(top_ids[i][: p.top_logprobs], top_values[i][: p.top_logprobs])) if p.logprobs and p.top_logprobs else None
            for i, p in enumerate(params)
        ]
        return result


def score_tokens(logits: torch.Tensor, targets: list[int], top_k: list[int]) -> list[TokenScore]:
    """Each row's logprob of its target token, with its ``top_k`` most likely alternatives.
    (logits: [rows, vocab] float32; the raw distribution, no sampling settings applied.)"""
    logprobs = torch.log_softmax(logits, dim=-1)
    chosen = logprobs.gather(1, torch.tensor(targets).unsqueeze(1)).squeeze(1).tolist()
    top_values, top_ids = logprobs.topk(max(1, max(top_k)), dim=-1)
    top_values, top_ids = top_values.tolist(), top_ids.tolist()
    return [TokenScore(target, lp, list(zip(ids[:k], values[:k])))
            for target, lp, ids, values, k in zip(targets, chosen, top_ids, top_values, top_k)]


def apply_logit_bias(logits: torch.Tensor, params: list[SamplingParams]) -> None:
    for row, p in enumerate(params):
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()))
            logits[row, ids] += torch.tensor(list(p.logit_bias.values()), dtype=logits.dtype)


def apply_penalties(logits: torch.Tensor, seqs: list[Context]) -> None:
    """OpenAI presence/frequency penalties over generated tokens; repetition penalty (CTRL-style,
    as in HF and vLLM) over prompt and generated tokens."""
    rows = [
        i
        for i, s in enumerate(seqs)
        if s.params.presence_penalty or s.params.frequency_penalty or s.params.repetition_penalty != 1.0
    ]
    if not rows:
        return
    vocab = logits.shape[1]
    for row in rows:
        ctx, p = seqs[row], seqs[row].params
        if p.presence_penalty or p.frequency_penalty:
            generated = ctx.generated_token_ids()
            counts = torch.bincount(torch.tensor(generated, dtype=torch.long), minlength=vocab)[:vocab].to(logits.dtype)
            logits[row] -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(logits.dtype)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(ctx.token_ids)), dtype=torch.long)
            values = logits[row, seen]
            logits[row, seen] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)


def filter_top_k_top_p_min_p(probs: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
    """Zeroes the tokens each row's top_k / top_p / min_p excludes (probs: [batch, vocab])."""
    vocab = probs.shape[1]
    top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params])
    top_p = torch.tensor([p.top_p for p in params], dtype=probs.dtype)
    min_p = torch.tensor([p.min_p for p in params], dtype=probs.dtype)
    if bool((min_p > 0).any()):
        probs = probs.masked_fill(probs < min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values, 0.0)
    if bool((top_k < vocab).any()) or bool((top_p < 1.0).any()):
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        rank = torch.arange(vocab).unsqueeze(0)
        # Keep a token while the mass strictly before it is below top_p (the first always stays).
        mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
        drop = (rank >= top_k.unsqueeze(1)) | (mass_before >= top_p.unsqueeze(1) * sorted_probs.sum(-1, keepdim=True))
        drop[:, 0] = False  # top_p = 0 (OpenAI's "near-greedy") still keeps the most likely token
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.empty_like(probs).scatter_(1, order, sorted_probs)
    return probs
