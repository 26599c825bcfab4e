"""The sampling fields, declared once: the OpenAI requests, the builtin engine's context API and the
semantic-call outputs all derive from ``Sampling`` (``SamplingWithHints``), and the builtin engine
turns them into its normalised ``SamplingParams`` in one function (engines/builtin/serving/sampling.py)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from msgspec import Meta, Struct

from wire.errors import InvalidRequest

Criteria = Literal["latency", "throughput"]  # what a request's sender needs: fast tokens, or big batches
# OpenAI's ``service_tier`` read as criteria: "flex" (slower, cheaper) is throughput work, "priority" latency
# work; "default", "auto" and any other value leave the criteria as they would be without it.
SERVICE_TIER_CRITERIA: dict[str, Criteria] = {"flex": "throughput", "priority": "latency"}
Probability = Annotated[float, Meta(ge=0.0, le=1.0)]
Penalty = Annotated[float, Meta(ge=-2.0, le=2.0)]
Seed = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # a 64-bit integer, as vLLM takes it
# A 32-bit integer: room for the gateway's own ranks (about ±2**20, gateway/semantic/graph.py) and
# any client's, while a huge number cannot ride through the engine's scheduler arithmetic.
Priority = Annotated[int, Meta(ge=-(2**31), le=2**31 - 1)]


class Sampling(Struct, kw_only=True, omit_defaults=True):
    """How tokens are chosen, with OpenAI's ranges (vLLM's for its extras); unset is None."""

    max_tokens: Annotated[int, Meta(ge=0)] | None = None  # 0 only to score an echoed prompt (completions)
    temperature: Annotated[float, Meta(ge=0.0, le=2.0)] | None = None
    top_p: Probability | None = None
    top_k: Annotated[int, Meta(ge=-1)] | None = None  # -1 or 0: disabled
    min_p: Probability | None = None
    seed: Seed | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool | None = False
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Meta(gt=0.0)] | None = None
    logit_bias: dict[str, Annotated[float, Meta(ge=-100.0, le=100.0)]] | None = None

    def stop_list(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else list(self.stop)


class SamplingWithHints(Sampling, kw_only=True, omit_defaults=True):
    """The sampling fields plus the scheduling hints an engine that takes them (Parrot's builtin one; vLLM
    reads ``priority``) uses to order work, and how a gateway bounds a request that names no max_tokens.
    (One chain of Structs, not mixins: msgspec Structs take one base with fields.)"""

    priority: Priority | None = 0  # as vLLM: larger runs first (Parrot sends it for latency-critical and app-FIFO work)
    # "throughput" work may wait for a bigger batch (the builtin engine's latency_max_num_seqs).
    criteria: Criteria | None = None
    # Without max_tokens: generate at most this many tokens per choice (fewer when the context window has
    # less room left). How a gateway's cap bounds a request that names no max_tokens without the 400 that
    # a max_tokens beyond the room left would get.
    max_tokens_limit: Annotated[int, Meta(ge=1)] | None = None


SAMPLING_FIELDS: tuple[str, ...] = Sampling.__struct_fields__
SCHEDULING_FIELDS: tuple[str, ...] = tuple(f for f in SamplingWithHints.__struct_fields__ if f not in SAMPLING_FIELDS)


def check_sampling(sampling: Sampling) -> None:
    """The rules ``Meta`` ranges cannot state."""
    for key in sampling.logit_bias or ():
        if not key.lstrip("-").isdigit():
            raise InvalidRequest(f"logit_bias keys must be token ids, got {key!r}", "logit_bias")


def sampling_of(body: dict[str, Any]) -> dict[str, Any]:
    """The sampling fields set in a request body, ``max_completion_tokens`` (chat's name) as ``max_tokens``."""
    sampling = {k: body[k] for k in SAMPLING_FIELDS if body.get(k) is not None}
    limit = body.get("max_completion_tokens")
    if limit is not None:
        sampling["max_tokens"] = limit
    return sampling


def tier_criteria(body: dict[str, Any]) -> Criteria | None:
    """The criteria a request body's ``service_tier`` asks for; None: none (or a tier that names none)."""
    tier = body.get("service_tier")
    return SERVICE_TIER_CRITERIA.get(tier) if isinstance(tier, str) else None


def affinity_key(body: dict[str, Any]) -> str | None:
    """A request body's ``prompt_cache_key`` (OpenAI's): requests with the same key are placed together."""
    key = body.get("prompt_cache_key")
    return key if isinstance(key, str) and key else None
