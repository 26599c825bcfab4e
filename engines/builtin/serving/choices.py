"""One choice's output: token events turned into text pieces (incremental detokenizing, stop strings,
the choice's one finish), accumulated for a whole answer; a request's prompts as jobs; usage."""

from __future__ import annotations

from contextlib import aclosing
from dataclasses import dataclass, field
from typing import AsyncIterator


from engines.builtin.tokenizer import IncrementalDetokenizer
from engines.builtin.types import SamplingParams, TokenEvent
from wire.openai import (
    Usage,
)


@dataclass
class Piece:
    """What one choice adds in one step: released text, the tokens since the last piece."""

    text: str
    token_ids: list[int]
    events: list[TokenEvent]  # the same tokens with their logprobs
    finish_reason: str | None = None


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
                yield Piece(text, [e.token_id for e in pending], pending, finish)
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

    def add(self, piece: Piece) -> None:
        self.text += piece.text
        self.token_ids += piece.token_ids
        self.events += piece.events
        self.finish_reason = piece.finish_reason or self.finish_reason


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



def usage_of(prompt_tokens: int, completion_tokens: int) -> Usage:
    return Usage(prompt_tokens, completion_tokens, prompt_tokens + completion_tokens)


def usage(jobs: list[PromptJob], results: list[ChoiceResult]) -> Usage:
    return usage_of(sum(len(job.tokens) for job in jobs), sum(len(r.token_ids) for r in results))
