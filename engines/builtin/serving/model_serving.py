"""What every OpenAI surface of the builtin engine shares: the model's tokenizer and limits, and
running a request's prompt jobs on the core (n choices as forks of one filled prompt)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, AsyncIterator, Iterable


from engines.builtin.splicing import TokenSplicer
from engines.builtin.tokenizer import IncrementalDetokenizer, TokenTexts
from engines.builtin.types import SamplingParams, TokenEvent
from wire.errors import InvalidRequest
from wire.openai import (
    ChatCompletionRequest,
    CompletionRequest,
    new_id,
)
from engines.builtin.serving.errors import EngineBadRequest, translate
from engines.builtin.serving.choices import ChoiceResult, Piece, PromptJob, decode_events
from engines.builtin.serving.merge import merge, merge_tagged
from engines.builtin.serving.sampling import check_token_ids, sampling_params
from engines.builtin.serving.logprobs import LogprobsWriter
from engines.builtin.serving.named_outputs import NamedOutputs

if TYPE_CHECKING:
    from engines.builtin.core import EngineCore


@dataclass(frozen=True)
class Shared:
    """What the surfaces of one engine share, made once: the core, the model's name and tokenizer, and the
    generations' outputs kept by name for the requests that take them as input."""

    llm: EngineCore
    model_name: str
    tokenizer: Any
    token_texts: TokenTexts
    eos_token_ids: frozenset[int]
    named_outputs: NamedOutputs
    splicer: TokenSplicer

    @classmethod
    def of(cls, llm: EngineCore, model_name: str) -> "Shared":
        return cls(llm, model_name, llm.tokenizer, TokenTexts(llm.tokenizer), frozenset(llm.eos_token_ids),
                   NamedOutputs(), TokenSplicer(llm.tokenizer))


class ModelServing:
    """The base of each surface (chat.py, completions.py, contexts.py)."""

    def __init__(self, shared: Shared):
        self.llm = shared.llm
        self.model_name = shared.model_name
        self.tokenizer = shared.tokenizer
        self.vocab_size = len(shared.tokenizer)
        self.eos_token_ids = shared.eos_token_ids
        self.logprobs = LogprobsWriter(shared.tokenizer, shared.token_texts)
        self.named_outputs = shared.named_outputs
        self.splicer = shared.splicer

    def sampling_params(self, request: Any, prompt_len: int, *, logprobs: bool, top_logprobs: int,
                        prompt_param: str = "prompt") -> SamplingParams:
        return sampling_params(request, prompt_len, max_model_len=self.llm.max_model_len, vocab_size=self.vocab_size,
                               logprobs=logprobs, top_logprobs=top_logprobs, prompt_param=prompt_param)

    def check_token_ids(self, token_ids: Iterable[int], param: str) -> None:
        check_token_ids(token_ids, self.vocab_size, param)

    def hidden_ids(self, params: SamplingParams) -> frozenset[int]:
        """Token ids that end a choice without being part of its text (EOS, stop_token_ids)."""
        return self.eos_token_ids | frozenset(params.stop_token_ids)

    async def collect(self, jobs: list[PromptJob], pieces: AsyncIterator[tuple[int, Piece]] | None = None
                       ) -> list[ChoiceResult]:
        results = [ChoiceResult() for job in jobs for _ in job.params]
        async for index, piece in pieces or self.run_all(jobs):
            results[index].add(piece)
        return results

    def run_all(self, jobs: list[PromptJob]) -> AsyncIterator[tuple[int, Piece]]:
        streams = [self._run_job(job) for job in jobs]
        return streams[0] if len(streams) == 1 else merge_tagged(streams)

    async def _run_job(self, job: PromptJob) -> AsyncIterator[tuple[int, Piece]]:
        """All choices of one prompt, interleaved as they are produced, tagged with choice index."""
        try:
            if len(job.params) == 1:
                events = self.llm.generate_from_prompt(job.tokens, job.params[0])
                async for piece in self.pieces(events, job, job.params[0]):
                    yield job.first_index, piece
                return
            # n > 1: compute the prompt once and fork it, so every choice shares its KV blocks.
            # The parent holds all but the last token: each choice computes that one itself
            # (it needs its logits anyway) in a temporary child the core frees when it ends.
            *shared, last = job.tokens
            parent = new_id("prompt") if shared else None  # named up front so a cancelled fill is freed too
            try:
                if parent is not None:
                    await self.llm.fill(shared, context_id=parent)
                streams = [
                    self.pieces(self.llm.generate_from_prompt([last], p, parent_context_id=parent), job, p)
                    for p in job.params
                ]
                async for offset, piece in merge(streams):
                    yield job.first_index + offset, piece
            finally:
                if parent is not None:
                    await self.free_quietly(parent)
        except Exception as exc:
            raise translate(exc) from exc

    def pieces(self, events: AsyncIterator[TokenEvent], job: PromptJob, params: SamplingParams) -> AsyncIterator[Piece]:
        detok = IncrementalDetokenizer(self.tokenizer, job.stop, job.tokens)
        return decode_events(events, detok, self.hidden_ids(params))

    async def free_quietly(self, context_id: str) -> None:
        try:
            await asyncio.shield(self.llm.free_context(context_id))
        except (KeyError, asyncio.CancelledError):
            pass  # already evicted, or we are being torn down (the shielded free still completes)


def validate_request(request: ChatCompletionRequest | CompletionRequest) -> None:
    try:
        request.validate()
    except InvalidRequest as exc:
        raise EngineBadRequest(str(exc), exc.param) from exc
    unimplemented = request.unimplemented_extras()
    if unimplemented:
        raise EngineBadRequest(f"{unimplemented[0]} is not supported by the builtin engine", unimplemented[0])
