"""Types shared by the builtin engine's core (scheduler, runner, sampler) and its serving layer."""

from __future__ import annotations

import msgspec


class SamplingParams(msgspec.Struct, kw_only=True):
    """Per-sequence sampling settings, already normalised (no OpenAI optionals left)."""

    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 disables
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] | None = None
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # Latency-critical work is scheduled first (the priority hook); larger runs first.
    priority: int = 0
    # The sender tolerates slower tokens for a bigger batch (EngineConfig.latency_max_num_seqs).
    throughput: bool = False
    # An llguidance grammar (grammar.py) the output must follow; None leaves it free.
    grammar: str | None = None

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


class TokenEvent(msgspec.Struct):
    """One generated token as the engine core emits it.

    ``finish_reason`` is set on the last event of a sequence: "stop" (EOS or a stop token id),
    "length" (max_tokens or context window) or "abort".
    """

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    finish_reason: str | None = None
    step: int = 0  # the engine step that produced it (how the token-id handoff's wait is measured)
    # On a generation's first token: of its prompt's tokens, those it did not compute (shared from a
    # parent context or found in the prefix cache): OpenAI's usage.prompt_tokens_details.cached_tokens.
    cached_tokens: int | None = None


class TokenScore(msgspec.Struct):
    """How likely the model found one prompt token after the tokens before it (echo + logprobs)."""

    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = []
