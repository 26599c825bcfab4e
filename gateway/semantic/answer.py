"""A call's answer, and where it goes for the client waiting on it.

An answer is a response Struct (wire/openai.py) when the gateway wrote it (a fork's generation, a stream
gathered whole), or the engine's own bytes when a plain request answered whole: those pass through as they
came, so an upstream's own fields reach the client, and are read once, for their text and the metrics
(``AnswerRead``). Either is encoded once, at the edge, where the ``parrot`` object is added.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import msgspec

from engines.seam import EngineError, Route
from gateway.semantic.streaming import TextSink
from gateway.service import Answer as EngineAnswer
from wire.openai import (ChatChoice, ChatCompletion, Completion, CompletionChoice, PromptTokensDetails,
                         ResponseMessage, Usage)
from wire.usage import FinishOnly, UsageOnly

OpenAIResponse = ChatCompletion | Completion


class _Function(msgspec.Struct):
    arguments: str


class _ToolCall(msgspec.Struct):
    function: _Function


class _Message(msgspec.Struct):
    content: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(FinishOnly):
    text: str | None = None  # a completion's
    message: _Message | None = None  # a chat completion's


class AnswerRead(UsageOnly):
    """What the gateway reads of an engine's whole answer: usage, finish reasons, and each choice's text."""

    choices: list[_Choice] = []


class _ChoicesRead(msgspec.Struct):
    choices: list[_Choice] = []


_read_decoder = msgspec.json.Decoder(AnswerRead)
_choices_decoder = msgspec.json.Decoder(_ChoicesRead)


def read_answer(body: bytes) -> AnswerRead | None:
    """``body`` read once (for the metrics and the call's text); None when it is no OpenAI response."""
    try:
        return _read_decoder.decode(body)
    except msgspec.ValidationError:  # a usage of another shape (nulls): the text still counts, the usage not
        try:
            return AnswerRead(usage=None, choices=_choices_decoder.decode(body).choices)
        except msgspec.DecodeError:
            return None
    except msgspec.DecodeError:
        return None


class Answer(NamedTuple):
    """What the client waiting on a call gets (less the ``parrot`` object, added at the edge)."""

    body: OpenAIResponse | bytes  # bytes: the engine's own body, passed through untouched
    engine_id: str  # where it ran (the x-parrot-engine header)
    text: str  # the generated text of its first choice: what its output variable is bound to
    finish_reason: str | None  # of its first choice
    usage: Usage | None

    @classmethod
    def generated(cls, route: Route, model: str, text: str, finish_reason: str | None, usage: Usage,
                  engine_id: str) -> Answer:
        """The answer the gateway writes for one generated choice (a fork's, or a stream gathered whole)."""
        if route == "completions":
            body: OpenAIResponse = Completion(model=model, usage=usage, choices=[
                CompletionChoice(index=0, text=text, finish_reason=finish_reason)])
        else:
            body = ChatCompletion(model=model, usage=usage, choices=[
                ChatChoice(index=0, message=ResponseMessage(content=text), finish_reason=finish_reason)])
        return cls(body, engine_id, text, finish_reason, usage)

    @classmethod
    def passed_through(cls, route: Route, answer: EngineAnswer) -> Answer:
        """An engine's whole answer to a plain request, as ``read_answer`` read it."""
        read = answer.reported if isinstance(answer.reported, AnswerRead) else read_answer(answer.body)
        try:
            if read is None:  # the engine answered 200 with something else: decoded again for the reason
                _choices_decoder.decode(answer.body)
            choice = read.choices[0]
        except (msgspec.DecodeError, LookupError, AttributeError) as exc:
            raise EngineError(f"the engine's answer is not an OpenAI {route} response ({exc})") from None
        return cls(answer.body, answer.engine_id, _text_of(route, choice), choice.finish_reason, read.usage)

    def encoded(self, parrot: bytes) -> bytes:
        """The body with the ``parrot`` object (encoded) as its last member: the one encoding of the answer."""
        body = self.body if isinstance(self.body, bytes) else msgspec.json.encode(self.body)
        if b'"parrot"' in body:  # an upstream's own member of that name (rare): replaced, not doubled
            return msgspec.json.encode(msgspec.json.decode(body) | {"parrot": msgspec.Raw(parrot)})
        return body.rstrip()[:-1] + b',"parrot":' + parrot + b"}"  # an engine's bytes are not decoded again

    def as_dict(self) -> dict[str, Any]:
        """The body as builtins, for re-framing a whole answer as a stream."""
        return msgspec.json.decode(self.body) if isinstance(self.body, bytes) else msgspec.to_builtins(self.body)


def _text_of(route: Route, choice: _Choice) -> str:
    """A choice's generated text: a completion's text, a message's content, or a tool call's arguments."""
    if route == "completions":
        return choice.text or ""
    message = choice.message or _Message()
    if message.content is None and message.tool_calls:
        return message.tool_calls[0].function.arguments
    return message.content or ""


def usage_of(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None) -> Usage:
    """``cached_tokens``: None when the engine did not say (an upstream without the figure)."""
    details = PromptTokensDetails(cached_tokens=cached_tokens) if cached_tokens is not None else None
    return Usage(prompt_tokens=prompt_tokens, completion_tokens=completion_tokens,
                 total_tokens=prompt_tokens + completion_tokens, prompt_tokens_details=details)


class Reply:
    """Where the client waiting on a call gets its answer: its text as it is generated (``sink``, when it
    streams) and the answer of its last step. The request that waits holds it; the call lets go of it when
    it ends, so a finished call keeps no answer alive."""

    def __init__(self, sink: TextSink | None = None):
        self.sink = sink
        self.answer: Answer | None = None
