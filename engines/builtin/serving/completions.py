"""POST /v1/completions on the builtin engine: several prompts, n choices, echo and prompt scoring."""

from __future__ import annotations

import asyncio
from typing import AsyncIterator


from engines.builtin.tokenizer import text_tokens
from wire.openai import (
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    Usage,
    encoder,
    new_id,
    now,
)
from engines.builtin.serving.errors import EngineBadRequest, translate
from engines.builtin.serving.choices import Piece, PromptJob, UsageCount, usage
from engines.builtin.serving.model_serving import ModelServing, validate_request
from engines.builtin.serving.sampling import per_choice


class Completions(ModelServing):

    async def create(self, request: CompletionRequest) -> Completion:
        jobs, echoes = self._jobs(request)
        echo_logprobs = await self._echo_logprobs(request, jobs, echoes)
        results = await self.collect(jobs, self._pieces(request, jobs))
        choices = []
        for i, r in enumerate(results):
            echo = echoes[i // request.n] if request.echo else ""
            logprobs = None
            if request.logprobs is not None:
                logprobs = self.logprobs.completion(r.events, len(echo))
                if echo_logprobs:
                    logprobs = _joined(echo_logprobs[i // request.n], logprobs)
            choices.append(CompletionChoice(index=i, text=echo + r.text, finish_reason=r.finish_reason, logprobs=logprobs))
        return Completion(model=self.model_name, choices=choices, usage=usage(jobs, results))

    async def stream(self, request: CompletionRequest) -> AsyncIterator[bytes]:
        """The response's chunks, encoded (SSE framing is the caller's)."""
        jobs, echoes = self._jobs(request)
        chunk_id, created = new_id("cmpl"), now()

        def chunk(choices: list[CompletionChoice], usage: Usage | None = None) -> bytes:
            return encoder.encode(Completion(model=self.model_name, choices=choices, id=chunk_id, created=created, usage=usage))

        echo_logprobs = await self._echo_logprobs(request, jobs, echoes)
        if request.echo:
            yield chunk([CompletionChoice(index=i, text=echoes[i // request.n],
                                          logprobs=echo_logprobs[i // request.n] if echo_logprobs else None)
                         for job in jobs for i in job.indices])
        text_offsets = [len(echoes[i // request.n]) if request.echo else 0 for job in jobs for i in job.indices]
        count = UsageCount(jobs)
        async for index, piece in self._pieces(request, jobs):
            count.add(index, piece.token_ids, piece.events)
            logprobs = None
            if request.logprobs is not None:
                logprobs = self.logprobs.completion(piece.events, text_offsets[index])
                text_offsets[index] += sum(len(t) for t in logprobs.tokens)
            yield chunk([CompletionChoice(index, piece.text, piece.finish_reason, logprobs)])
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], count.usage())

    def _jobs(self, request: CompletionRequest) -> tuple[list[PromptJob], list[str]]:
        validate_request(request)
        if request.suffix:
            raise EngineBadRequest("suffix (insertion) is not supported by this engine", "suffix")
        if request.best_of is not None and request.best_of != request.n:
            raise EngineBadRequest("best_of is not supported by this engine: leave it out or equal to n", "best_of")
        jobs, echoes = [], []
        for prompt in request.prompts():
            tokens = text_tokens(self.tokenizer, prompt) if isinstance(prompt, str) else list(prompt)
            if not tokens:
                raise EngineBadRequest("prompt must not be empty", "prompt")
            self.check_token_ids(tokens, "prompt")
            params = self.sampling_params(
                request, len(tokens), logprobs=request.logprobs is not None, top_logprobs=request.logprobs or 0
            )
            jobs.append(PromptJob(tokens, per_choice(params, request.n), len(jobs) * request.n, request.stop_list()))
            if request.echo:
                echoes.append(prompt if isinstance(prompt, str) else self.tokenizer.decode(tokens))
        return jobs, echoes

    def _pieces(self, request: CompletionRequest, jobs: list[PromptJob]) -> AsyncIterator[tuple[int, Piece]]:
        """The choices' pieces; with max_tokens 0 (an echoed prompt only scored) each just ends."""
        return _nothing_generated(jobs) if request.max_tokens == 0 else self.run_all(jobs)

    async def _echo_logprobs(self, request: CompletionRequest, jobs: list[PromptJob],
                             echoes: list[str]) -> list[CompletionLogprobs]:
        """With echo and logprobs: each prompt's own tokens scored, as OpenAI's legacy completions
        (and evaluation harnesses reading loglikelihoods through them) expect. Empty otherwise."""
        if not request.echo or request.logprobs is None:
            return []
        counted = request.max_tokens == 0  # else the generation from the same prompt counts it
        tasks = [asyncio.ensure_future(self.llm.score(job.tokens, request.logprobs, priority=request.priority,
                                                      counted=counted)) for job in jobs]
        try:
            scored = await asyncio.gather(*tasks)  # all prompts in one batch
        except Exception as exc:
            for task in tasks:  # one failed: the others are of no use
                task.cancel()
            raise translate(exc) from exc
        texts = self.logprobs.token_texts
        out = []
        for job, scores, echo in zip(jobs, scored, echoes):
            out.append(CompletionLogprobs(
                tokens=[texts.text(t) for t in job.tokens],
                token_logprobs=[None, *(s.logprob for s in scores)],
                top_logprobs=[None, *(self.logprobs.top_dict(t, s.logprob, s.top_logprobs)
                                      for t, s in zip(job.tokens[1:], scores))],
                text_offset=self.logprobs.offsets(echo, job.tokens)))
        return out


async def _nothing_generated(jobs: list[PromptJob]) -> AsyncIterator[tuple[int, Piece]]:
    for job in jobs:
        for index in job.indices:
            yield index, Piece("", [], [], "length")


def _joined(first: CompletionLogprobs, then: CompletionLogprobs) -> CompletionLogprobs:
    return CompletionLogprobs(first.tokens + then.tokens, first.token_logprobs + then.token_logprobs,
                              first.top_logprobs + then.top_logprobs, first.text_offset + then.text_offset)
