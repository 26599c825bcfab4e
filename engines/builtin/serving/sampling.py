"""A request's sampling fields (wire/sampling.py) as the core's normalised SamplingParams, held to the
model's context window and vocabulary: the one place they are derived."""

from __future__ import annotations

from typing import Any, Iterable, TypeVar

import msgspec

from engines.builtin.types import SamplingParams
from engines.builtin.serving.errors import ContextLengthExceeded, EngineBadRequest
from wire.openai import (
    COMPLETIONS_DEFAULT_MAX_TOKENS,
    CompletionRequest,
)

T = TypeVar("T")


def sampling_params(request: Any, prompt_len: int, *, max_model_len: int, vocab_size: int, logprobs: bool,
                    top_logprobs: int, prompt_param: str = "prompt") -> SamplingParams:
    """A request's fields (unset = None) as normalised ``SamplingParams`` for a prompt of ``prompt_len``."""
    remaining = max_model_len - prompt_len
    if remaining < (0 if request.token_limit() == 0 else 1):  # 0: an echoed prompt only scored
        raise ContextLengthExceeded(f"the prompt is {prompt_len} tokens; this model's context window is {max_model_len}",
                                    prompt_param)
    limit = request.token_limit()
    if limit is not None and limit > remaining:  # as vLLM and OpenAI: an error, not a silently shorter answer
        raise ContextLengthExceeded(
            f"this model's context window is {max_model_len} tokens; the prompt is {prompt_len} and "
            f"{limit} more were asked for: reduce the prompt or max_tokens",
            "max_completion_tokens" if getattr(request, "max_completion_tokens", None) else "max_tokens")
    if limit is None:
        limit = default_max_tokens(request, remaining)
    logit_bias = {int(k): v for k, v in request.logit_bias.items()} if request.logit_bias else None
    if logit_bias:
        check_token_ids(logit_bias, vocab_size, "logit_bias")
    stop_token_ids = list(request.stop_token_ids or ())
    check_token_ids(stop_token_ids, vocab_size, "stop_token_ids")
    return SamplingParams(
        max_tokens=limit,
        temperature=_or(request.temperature, 1.0),
        top_p=_or(request.top_p, 1.0),
        top_k=request.top_k if request.top_k else -1,  # 0 and None both mean "disabled"
        min_p=_or(request.min_p, 0.0),
        seed=request.seed,
        presence_penalty=_or(request.presence_penalty, 0.0),
        frequency_penalty=_or(request.frequency_penalty, 0.0),
        repetition_penalty=_or(request.repetition_penalty, 1.0),
        logit_bias=logit_bias,
        stop_token_ids=stop_token_ids,
        ignore_eos=bool(request.ignore_eos),
        logprobs=logprobs,
        top_logprobs=top_logprobs,
        priority=request.priority or 0,
        throughput=request.criteria == "throughput",
    )


def check_token_ids(token_ids: Iterable[int], vocab_size: int, param: str) -> None:
    # An out-of-range id would fail inside the model's embedding, on the engine's thread.
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise EngineBadRequest(f"token ids out of range [0, {vocab_size}): {bad[:5]}", param)


def default_max_tokens(request: Any, remaining: int) -> int:
    """A choice's length when the request names no max_tokens: legacy completions 16 (as OpenAI's and
    vLLM's), anything else the room left in the context window; never above its max_tokens_limit (a
    gateway's cap)."""
    default = min(COMPLETIONS_DEFAULT_MAX_TOKENS, remaining) if isinstance(request, CompletionRequest) else remaining
    return min(default, request.max_tokens_limit or default)


def _or(value: T | None, default: T) -> T:
    return default if value is None else value


def per_choice(params: SamplingParams, n: int) -> list[SamplingParams]:
    """``n`` copies of ``params``; seeded requests give choice i the seed ``seed + i``."""
    if n == 1:
        return [params]
    seeds = [None] * n if params.seed is None else [params.seed + i for i in range(n)]
    return [msgspec.structs.replace(params, seed=seed) for seed in seeds]
