"""What one step of a continuous-batching engine costs, in seconds, and the engine's shape (its batching limits and
KV cache): the two things the simulated engine (engine.py) needs to know of the hardware and the serving stack.

A step computes a chunk of prompt tokens (chunked prefill) and one token of each decoding sequence together, as
vLLM's V1 scheduler builds its steps; its time is taken as linear in what it does:

    seconds = fixed + prefill_tokens × per_prefill_token + decoding_sequences × per_decoding_sequence
              + attention_pairs × per_attention_pair

where attention_pairs counts (query token, key token) pairs: a decoding sequence's one query over its whole
context, a prompt chunk's queries over the tokens before them and themselves. On a CPU the last term is what
makes 16 requests on a 900-token prompt decode slower than 16 on a 40-token one.
"""

from __future__ import annotations

import msgspec


class StepCost(msgspec.Struct, frozen=True, kw_only=True):
    fixed_s: float  # a step's floor: weights read once, kernel launches, the scheduler's own time
    prefill_token_s: float  # each prompt token computed in the step
    decode_seq_s: float  # each sequence that decodes one token in the step
    attention_pair_s: float = 0.0  # each (query token, key token) pair attended
    request_s: float = 0.0  # the API server's time per request before the engine sees it (one at a time)

    def seconds(self, prefill_tokens: int, decoding: int, pairs: float = 0.0) -> float:
        if prefill_tokens <= 0 and decoding <= 0:
            return 0.0
        return (self.fixed_s + prefill_tokens * self.prefill_token_s + decoding * self.decode_seq_s
                + pairs * self.attention_pair_s)


def chunk_pairs(before: int, chunk: int) -> float:
    """(query, key) pairs of a prompt chunk of ``chunk`` tokens after ``before`` tokens (causal attention)."""
    return chunk * before + chunk * (chunk + 1) / 2


class EngineShape(msgspec.Struct, frozen=True, kw_only=True):
    """The serving limits of one engine (vLLM's scheduler and cache config)."""

    max_batched_tokens: int  # --max-num-batched-tokens: prompt chunk + decodes of one step
    max_seqs: int  # --max-num-seqs
    block_size: int  # tokens per KV block; the prefix cache keeps full blocks only
    kv_blocks: int  # KV blocks the engine holds, cached prefixes and running sequences together
    priority: bool = False  # --scheduling-policy priority: the waiting queue ordered by a request's priority
