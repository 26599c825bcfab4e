"""One choice's output: token events turned into text pieces (incremental detokenizing, stop strings,
the choice's one finish), accumulated for a whole answer; a request's prompts as jobs; usage."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator


from engines.builtin.tokenizer import IncrementalDetokenizer
from engines.builtin.types import SamplingParams, TokenEvent
from wire.openai import PromptTokensDetails, Usage


@dataclass
class Piece:
    """What one choice adds in one step: released text, the tokens since the last piece."""

    text: str
    token_ids: list[int]
    events: list[TokenEvent]  # the same tokens with their logprobs
    finish_reason: str | None = None
    stop_reason: str | None = None  # the stop string that ended the choice


async def decode_events(
    events: AsyncIterator[TokenEvent], detok: IncrementalDetokenizer, hidden_stop_ids: frozenset[int]
) -> AsyncIterator[Piece]:
    """Turns a token stream into text pieces; leaving early (a stop string) aborts the sequence."""
    pending: list[TokenEvent] = []
    async with aclosing(events):
        async for event in events:
            pending.append(event)
            finish = event.finish_reason
            # EOS / stop_token_ids end the text without being part of it, as OpenAI does.
            hidden = finish == "stop" and event.token_id in hidden_stop_ids
            text = "" if hidden else detok.push(event.token_id)
            if detok.stopped:
                finish = "stop"
            elif finish is not None:
                text += detok.finish()
            if text or finish is not None:
                yield Piece(text, [e.token_id for e in pending], pending, finish, detok.stop_reason)
                pending = []
            if finish is not None:
                return
    yield Piece(detok.finish(), [e.token_id for e in pending], pending, "abort")  # core stopped without a reason


@dataclass
class ChoiceResult:
    """One choice accumulated for a non-streaming response."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    events: list[TokenEvent] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | None = None

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.token_ids += piece.token_ids
        self.events += piece.events
        self.finish_reason = piece.finish_reason or self.finish_reason
        self.stop_reason = piece.stop_reason or self.stop_reason


@dataclass
class PromptJob:
    """One prompt of a request and the choices sampled from it."""

    tokens: list[int]
    params: list[SamplingParams]  # one per choice
    first_index: int  # choice index of params[0] in the response
    stop: list[str]
    tool_calls: bool = False  # the output follows the tools grammar and is read as tool calls

    @property
    def indices(self) -> range:
        return range(self.first_index, self.first_index + len(self.params))



def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens,
                 PromptTokensDetails(cached_tokens=cached_tokens))


def cached_tokens(events: list[TokenEvent]) -> int | None:
    """What a choice's first token says of its prompt's cached tokens; None before it."""
    return events[0].cached_tokens if events else None


class UsageCount:
    """A request's usage as its choices' pieces arrive. Each prompt counts once, its cached tokens as its
    least cached choice found them (the first computes what the others then find cached)."""

    def __init__(self, jobs: list[PromptJob]):
        self.jobs = jobs
        self.completion_tokens = 0
        self._cached: dict[int, int] = {}

    def add(self, index: int, token_ids: list[int], events: list[TokenEvent]) -> None:
        self.completion_tokens += len(token_ids)
        cached = cached_tokens(events)
        if cached is not None and index not in self._cached:
            self._cached[index] = cached

    def usage(self) -> Usage:
        cached = sum(min((self._cached.get(i, 0) for i in job.indices), default=0) for job in self.jobs)
        return usage_of(sum(len(job.tokens) for job in self.jobs), self.completion_tokens, cached)


def usage(jobs: list[PromptJob], results: list[ChoiceResult]) -> Usage:
    count = UsageCount(jobs)
    for index, result in enumerate(results):
        count.add(index, result.token_ids, result.events)
    return count.usage()
