"""A chat completion, whole or streamed, as the translations read it: its choices' text, tool calls, finish
(and, where the engine says, the stop string that ended it), its usage with cached tokens, and a stream's
chunks out of the gateway's SSE bytes."""

from __future__ import annotations

from typing import Any, Iterator

import msgspec
from msgspec import Struct, field

from wire.openai import ErrorBody, Usage


class ToolCallFunction(Struct):
    name: str | None = None
    arguments: str | None = None


class ToolCall(Struct):
    id: str | None = None
    function: ToolCallFunction = field(default_factory=ToolCallFunction)
    index: int = 0


class Message(Struct):
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class Choice(Struct):
    message: Message = field(default_factory=Message)
    finish_reason: str | None = None
    stop_reason: str | int | None = None  # vLLM's and the builtin engine's: the stop string (or token) that ended it


class Completion(Struct):
    choices: list[Choice] = field(default_factory=list)
    usage: Usage | None = None
    service_tier: str | None = None


class ChunkChoice(Struct):
    delta: Message = field(default_factory=Message)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    index: int = 0


class Chunk(Struct):
    choices: list[ChunkChoice] = field(default_factory=list)
    usage: Usage | None = None
    error: ErrorBody | None = None  # the gateway's SSE error object: the engine failed mid-stream


completion_decoder = msgspec.json.Decoder(Completion)
chunk_decoder = msgspec.json.Decoder(Chunk)


def cached_tokens(usage: Usage | None) -> int:
    """The prompt tokens the engine served from its prefix cache or a forked context (0: it did not say)."""
    details = usage.prompt_tokens_details if usage is not None else None
    return details.cached_tokens if details is not None else 0


class ChunkReader:
    """The chunks in the gateway's SSE bytes (``data: PAYLOAD`` events, ``[DONE]`` skipped), whatever
    the reads' boundaries."""

    def __init__(self) -> None:
        self._buffer = b""

    def feed(self, data: bytes) -> Iterator[Chunk]:
        self._buffer += data
        *events, self._buffer = self._buffer.split(b"\n\n")
        for event in events:
            for line in event.split(b"\n"):
                if line.startswith(b"data:"):
                    payload = line[5:].strip()
                    if payload and payload != b"[DONE]":
                        yield chunk_decoder.decode(payload)


def chat_body(messages: list[dict[str, Any]], **fields: Any) -> dict[str, Any]:
    """A chat completions body: the messages and the fields that are set (None ones left out)."""
    return {"messages": messages, **{name: value for name, value in fields.items() if value is not None}}
