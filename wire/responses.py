"""OpenAI Responses API bodies as msgspec Structs: the one definition of what POST /v1/responses takes,
what it answers, what its stream's events are and what GET .../input_items lists.

Input items are decoded one by one (``input_item``) so that a malformed one is named by its path
(``input[3].call_id``). Unknown fields are ignored, as elsewhere: new SDK fields never break a request.
"""

from __future__ import annotations

import time
import uuid
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct, field

from wire.errors import InvalidRequest

# ---------------------------------------------------------------- ids


def new_item_id(prefix: str) -> str:
    """OpenAI's ids: ``resp_``, ``msg_``, ``fc_`` and ``call_`` followed by hex."""
    return f"{prefix}_{uuid.uuid4().hex}"


# ---------------------------------------------------------------- content parts


class InputText(Struct, tag_field="type", tag="input_text"):
    text: str


class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str
    annotations: list[Any] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)


class Refusal(Struct, tag_field="type", tag="refusal"):
    refusal: str


class InputImage(Struct, tag_field="type", tag="input_image", omit_defaults=True):
    image_url: str | None = None
    file_id: str | None = None
    detail: str = "auto"


ContentPart = Union[InputText, OutputText, Refusal, InputImage]


def part_text(content: str | list[ContentPart]) -> str:
    """The text of a message's content, its text parts joined (images and refusals have none)."""
    if isinstance(content, str):
        return content
    return "".join(p.text for p in content if isinstance(p, (InputText, OutputText)))


# ---------------------------------------------------------------- items (input and output)


class MessageItem(Struct, tag_field="type", tag="message", omit_defaults=True):
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallItem(Struct, tag_field="type", tag="function_call", omit_defaults=True):
    call_id: Annotated[str, Meta(min_length=1)]
    name: Annotated[str, Meta(min_length=1)]
    arguments: str
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class FunctionCallOutputItem(Struct, tag_field="type", tag="function_call_output", omit_defaults=True):
    call_id: Annotated[str, Meta(min_length=1)]
    output: str | list[ContentPart]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class ReasoningItem(Struct, tag_field="type", tag="reasoning", omit_defaults=True):
    """Accepted in input (a client replays what another model answered) and skipped: no text to show."""

    id: str | None = None
    summary: list[Any] = field(default_factory=list)


class ItemReference(Struct, tag_field="type", tag="item_reference"):
    id: str


Item = Union[MessageItem, FunctionCallItem, FunctionCallOutputItem, ReasoningItem, ItemReference]


def input_item(raw: Any, at: str) -> Item:
    """One input item decoded; a message may leave out ``"type"`` (OpenAI's easy input message). Errors
    name the item's path: ``at`` (``input[3]``) and the field within it."""
    if isinstance(raw, dict) and "type" not in raw and "role" in raw:
        raw = {**raw, "type": "message"}
    try:
        return msgspec.convert(raw, Item)
    except msgspec.ValidationError as exc:
        message = str(exc)
        inner = message.rsplit("`$", 1)[1].rstrip("`") if "`$" in message else ""
        missing = message.partition("missing required field `")[2].partition("`")[0]
        param = at + inner + (f".{missing}" if missing else "")
        raise InvalidRequest(f"{param}: {message.split(' - at ')[0]}", param) from None


# ---------------------------------------------------------------- request


class FunctionTool(Struct, tag_field="type", tag="function", omit_defaults=True):
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class NamedFunction(Struct, tag_field="type", tag="function"):
    name: str


ToolChoice = Union[Literal["none", "auto", "required"], NamedFunction]


class TextFormat(Struct, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]  # always written out
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Struct, omit_defaults=True):
    format: TextFormat = field(default_factory=lambda: TextFormat(type="text"))


class ResponsesRequest(Struct, kw_only=True, omit_defaults=True):
    model: Annotated[str, Meta(min_length=1)]
    # A string (one user message) or items, each decoded by ``input_item`` (so its errors name its path).
    input: str | list[Any] = ""
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None  # checked one by one: tools[i]
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    max_output_tokens: Annotated[int, Meta(ge=1)] | None = None
    temperature: Annotated[float, Meta(ge=0, le=2)] | None = None
    top_p: Annotated[float, Meta(ge=0, le=1)] | None = None
    store: bool | None = True
    previous_response_id: str | None = None
    stream: bool | None = False
    background: bool | None = False
    metadata: dict[str, str] | None = None
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None


# ---------------------------------------------------------------- response


class InputTokensDetails(Struct):
    cached_tokens: int = 0


class OutputTokensDetails(Struct):
    reasoning_tokens: int = 0


class ResponseUsage(Struct):
    input_tokens: int = 0
    output_tokens: int = 0
    total_tokens: int = 0
    input_tokens_details: InputTokensDetails = field(default_factory=InputTokensDetails)
    output_tokens_details: OutputTokensDetails = field(default_factory=OutputTokensDetails)


class ResponseError(Struct):
    code: str
    message: str


class IncompleteDetails(Struct):
    reason: str


OutputItem = Union[MessageItem, FunctionCallItem]
Status = Literal["queued", "in_progress", "completed", "incomplete", "cancelled", "failed"]


class Response(Struct, kw_only=True):
    id: str = field(default_factory=lambda: new_item_id("resp"))
    object: str = "response"
    created_at: int = field(default_factory=lambda: int(time.time()))
    status: Status = "in_progress"
    model: str
    output: list[OutputItem] = field(default_factory=list)
    instructions: str | None = None
    tools: list[FunctionTool] = field(default_factory=list)
    tool_choice: ToolChoice = "auto"
    parallel_tool_calls: bool = True
    text: TextConfig = field(default_factory=TextConfig)
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    previous_response_id: str | None = None
    store: bool = True
    background: bool = False
    metadata: dict[str, str] = field(default_factory=dict)
    user: str | None = None
    service_tier: str = "default"
    truncation: str = "disabled"
    usage: ResponseUsage | None = None
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    # Parrot's extension: the semantic request's session and variables (left out of a plain response).
    parrot: dict[str, Any] | msgspec.UnsetType = msgspec.UNSET


class DeletedResponse(Struct):
    id: str
    object: str = "response"
    deleted: bool = True


class InputItemList(Struct):
    data: list[Item]
    first_id: str | None
    last_id: str | None
    has_more: bool
    object: str = "list"


# ---------------------------------------------------------------- stream events


class ResponseEvent(Struct, kw_only=True):
    """``response.created``, ``.in_progress``, ``.completed``, ``.incomplete``, ``.failed``."""

    type: str
    sequence_number: int
    response: Response


class OutputItemEvent(Struct, kw_only=True):
    """``response.output_item.added`` / ``.done``."""

    type: str
    sequence_number: int
    output_index: int
    item: OutputItem


class ContentPartEvent(Struct, kw_only=True):
    """``response.content_part.added`` / ``.done``."""

    type: str
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    part: OutputText


class TextDeltaEvent(Struct, kw_only=True):
    type: str = "response.output_text.delta"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    delta: str
    logprobs: list[Any] = field(default_factory=list)


class TextDoneEvent(Struct, kw_only=True):
    type: str = "response.output_text.done"
    sequence_number: int
    item_id: str
    output_index: int
    content_index: int
    text: str
    logprobs: list[Any] = field(default_factory=list)


class ArgumentsDeltaEvent(Struct, kw_only=True):
    type: str = "response.function_call_arguments.delta"
    sequence_number: int
    item_id: str
    output_index: int
    delta: str


class ArgumentsDoneEvent(Struct, kw_only=True):
    type: str = "response.function_call_arguments.done"
    sequence_number: int
    item_id: str
    output_index: int
    name: str
    arguments: str


StreamEvent = Union[ResponseEvent, OutputItemEvent, ContentPartEvent, TextDeltaEvent, TextDoneEvent,
                    ArgumentsDeltaEvent, ArgumentsDoneEvent]

encoder = msgspec.json.Encoder()


def sse(event: StreamEvent) -> bytes:
    """One event as the Responses API frames it: its type as the SSE event name, the event as data."""
    return b"event: " + event.type.encode() + b"\ndata: " + encoder.encode(event) + b"\n\n"
