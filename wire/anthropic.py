"""Anthropic's Messages API bodies as msgspec Structs: what POST /v1/messages and /v1/messages/count_tokens
take, what they answer, the stream's events and the error object. Unknown fields are ignored (new SDK fields
never break a request); a malformed block is named by its path (``messages[1].content[0].tool_use_id``)."""

from __future__ import annotations

import uuid
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct, field


def new_message_id() -> str:
    return f"msg_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- content blocks


class TextBlock(Struct, tag_field="type", tag="text"):
    text: str


class ImageSource(Struct, omit_defaults=True):
    type: Literal["base64", "url"]
    media_type: str | None = None
    data: str | None = None
    url: str | None = None


class ImageBlock(Struct, tag_field="type", tag="image"):
    source: ImageSource


class ToolUseBlock(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(Struct, tag_field="type", tag="tool_result", omit_defaults=True):
    tool_use_id: Annotated[str, Meta(min_length=1)]
    content: str | list[Union[TextBlock, ImageBlock]] = ""
    is_error: bool = False


class ThinkingBlock(Struct, tag_field="type", tag="thinking", omit_defaults=True):
    """Accepted in a history (another model's) and skipped: the engines here do not think aloud."""

    thinking: str = ""
    signature: str | None = None


class RedactedThinkingBlock(Struct, tag_field="type", tag="redacted_thinking", omit_defaults=True):
    data: str = ""


Block = Union[TextBlock, ImageBlock, ToolUseBlock, ToolResultBlock, ThinkingBlock, RedactedThinkingBlock]


class MessageParam(Struct):
    role: Literal["user", "assistant"]
    content: str | list[Block]


# ---------------------------------------------------------------- requests


class AnthropicTool(Struct, omit_defaults=True):
    name: Annotated[str, Meta(min_length=1, max_length=128)]
    input_schema: dict[str, Any] | None = None
    description: str | None = None
    type: str | None = None  # "custom" or none: a client tool; the server tools (web search, ...) are not served


class AnthropicToolChoice(Struct, omit_defaults=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class OutputFormat(Struct, omit_defaults=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(Struct, omit_defaults=True):
    format: OutputFormat | None = None  # structured output: the answer's text matches the schema
    effort: str | None = None  # accepted and ignored: the engines here do not reason at length


class CountTokensRequest(Struct, kw_only=True, omit_defaults=True):
    model: Annotated[str, Meta(min_length=1)]
    messages: Annotated[list[MessageParam], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: dict[str, Any] | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True, omit_defaults=True):
    max_tokens: Annotated[int, Meta(ge=1)]
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_k: Annotated[int, Meta(ge=0)] | None = None
    metadata: dict[str, Any] | None = None
    service_tier: str | None = None


# ---------------------------------------------------------------- responses


class AnthropicUsage(Struct):
    input_tokens: int = 0  # computed ones: Anthropic counts the cache's apart
    output_tokens: int = 0
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0  # the prompt tokens the engine served from its prefix cache or a fork
    service_tier: str = "standard"


class TextContent(Struct, tag_field="type", tag="text"):
    text: str


class ToolUseContent(Struct, tag_field="type", tag="tool_use"):
    id: str
    name: str
    input: dict[str, Any]


AnthropicContent = Union[TextContent, ToolUseContent]
AnthropicStopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]


class AnthropicMessage(Struct, kw_only=True):
    id: str = field(default_factory=new_message_id)
    type: str = "message"
    role: str = "assistant"
    model: str
    content: list[AnthropicContent] = field(default_factory=list)
    stop_reason: AnthropicStopReason | None = None
    stop_sequence: str | None = None
    usage: AnthropicUsage = field(default_factory=AnthropicUsage)
    # Parrot's extension: the semantic request's session and variables (left out of a plain message).
    parrot: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class TokenCount(Struct):
    input_tokens: int


class AnthropicErrorDetail(Struct):
    type: str
    message: str


class AnthropicError(Struct):
    error: AnthropicErrorDetail
    type: str = "error"


# ---------------------------------------------------------------- stream events


class MessageStart(Struct, tag_field="type", tag="message_start"):
    message: AnthropicMessage


class ContentBlockStart(Struct, tag_field="type", tag="content_block_start"):
    index: int
    content_block: AnthropicContent


class TextDelta(Struct, tag_field="type", tag="text_delta"):
    text: str


class InputJsonDelta(Struct, tag_field="type", tag="input_json_delta"):
    partial_json: str


class ContentBlockDelta(Struct, tag_field="type", tag="content_block_delta"):
    index: int
    delta: Union[TextDelta, InputJsonDelta]


class ContentBlockStop(Struct, tag_field="type", tag="content_block_stop"):
    index: int


class StopDelta(Struct):
    stop_reason: AnthropicStopReason | None
    stop_sequence: str | None = None


class MessageDelta(Struct, tag_field="type", tag="message_delta"):
    delta: StopDelta
    usage: AnthropicUsage


class MessageStop(Struct, tag_field="type", tag="message_stop"):
    pass


class Ping(Struct, tag_field="type", tag="ping"):
    pass


AnthropicStreamEvent = Union[MessageStart, ContentBlockStart, ContentBlockDelta, ContentBlockStop, MessageDelta, MessageStop,
                    Ping, AnthropicError]
EVENT_NAMES = {MessageStart: "message_start", ContentBlockStart: "content_block_start",
               ContentBlockDelta: "content_block_delta", ContentBlockStop: "content_block_stop",
               MessageDelta: "message_delta", MessageStop: "message_stop", Ping: "ping", AnthropicError: "error"}

encoder = msgspec.json.Encoder()


def sse(event: AnthropicStreamEvent) -> bytes:
    """One event as Anthropic frames it: its type as the SSE event name, the event as data."""
    return b"event: " + EVENT_NAMES[type(event)].encode() + b"\ndata: " + encoder.encode(event) + b"\n\n"
