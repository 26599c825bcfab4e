"""OpenAI wire schema as msgspec Structs: the one definition of every request and response body.

Requests are validated here (types and ranges through ``Meta``; cross-field rules in
``validate()``). Unknown fields are ignored rather than rejected, as OpenAI-compatible
servers do, so new SDK fields never break a request.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Annotated, Any, Literal, Union

import msgspec
from msgspec import Meta, Struct, field

from wire.errors import InvalidRequest
from wire.sampling import check_sampling
from wire.vllm import VLLMSampling

Role = Literal["system", "developer", "user", "assistant", "tool", "function"]
# Legacy completions without max_tokens generate this many tokens per choice, as OpenAI's and vLLM's do.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


# ---------------------------------------------------------------- request parts


class ContentPart(Struct, omit_defaults=True):
    type: str
    text: str | None = None
    image_url: dict[str, Any] | None = None


class FunctionCall(Struct):
    name: str
    arguments: str = ""


class ToolCall(Struct):  # always written out: clients expect "type" and "arguments"
    id: str
    function: FunctionCall
    type: str = "function"


class ChatMessage(Struct, omit_defaults=True):
    role: Role
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    function_call: dict[str, Any] | None = None  # OpenAI's deprecated form of one tool call, in old histories

    def text(self) -> str:
        """The message's text, parts joined; non-text parts are skipped."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content if part.type == "text")


PART_TYPES = ("text", "image_url", "input_audio", "file", "refusal")  # OpenAI's content part types
_FUNCTION_NAME = re.compile(r"[a-zA-Z0-9_-]{1,64}")


def _check_message(message: ChatMessage, at: str) -> None:
    """OpenAI's rules for one message: who needs content, a tool_call_id, known part types."""
    if message.content is None and not (message.role == "assistant" and (message.tool_calls or message.function_call)):
        needs = "content or tool_calls" if message.role == "assistant" else "content"
        raise InvalidRequest(f"{at}: the {message.role} message needs {needs}", f"{at}.content")
    if message.role == "tool" and not message.tool_call_id:
        raise InvalidRequest(f"{at}: a tool message needs the tool_call_id it answers", f"{at}.tool_call_id")
    for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
        if part.type not in PART_TYPES:
            raise InvalidRequest(f"{at}.content[{j}]: unknown content part type {part.type!r}; expected one of "
                                 + ", ".join(PART_TYPES), f"{at}.content[{j}].type")
        if part.type == "text" and part.text is None:
            raise InvalidRequest(f"{at}.content[{j}]: a text part needs text", f"{at}.content[{j}].text")


class FunctionDefinition(Struct, omit_defaults=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(Struct, omit_defaults=True):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class JsonSchemaFormat(Struct, omit_defaults=True):
    name: str = "response"
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(Struct, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StreamOptions(Struct, omit_defaults=True):
    include_usage: bool = False


class RequestFields(VLLMSampling, kw_only=True, omit_defaults=True):
    """What chat and text completions share: the sampling fields (wire/sampling.py, with vLLM's extras)
    and the request's own."""

    model: str
    n: Annotated[int, Meta(ge=1, le=128)] | None = 1
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    # Parrot's extension object; interpreted by the gateway, never forwarded upstream.
    parrot: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        # OpenAI's schema makes these nullable, null meaning the default: some clients send every field.
        self.n = 1 if self.n is None else self.n
        self.stream = bool(self.stream)
        self.ignore_eos = bool(self.ignore_eos)
        self.priority = self.priority or 0

    def choices(self) -> int:
        """How many choices the request generates."""
        return self.n or 1

    def _validate_common(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", "stream_options")
        check_sampling(self)


class ChatCompletionRequest(RequestFields, kw_only=True, omit_defaults=True):
    messages: Annotated[list[ChatMessage], Meta(min_length=1)]
    max_completion_tokens: Annotated[int, Meta(ge=1)] | None = None
    logprobs: bool | None = False
    top_logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    tools: list[Tool] | None = None
    tool_choice: Union[str, dict[str, Any], None] = None
    parallel_tool_calls: bool | None = None
    response_format: ResponseFormat | None = None
    service_tier: str | None = None  # echoed by the builtin engine (``served_tier``); upstreams answer their own

    def __post_init__(self) -> None:
        super().__post_init__()
        self.logprobs = bool(self.logprobs)

    def validate(self) -> None:
        self._validate_common()
        if self.max_tokens == 0:
            raise InvalidRequest("max_tokens must be at least 1", "max_tokens")
        for i, message in enumerate(self.messages):
            _check_message(message, f"messages[{i}]")
        self._check_tools()
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", "top_logprobs")
        if isinstance(self.tool_choice, str) and self.tool_choice not in ("none", "auto", "required"):
            raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or a named function", "tool_choice")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise InvalidRequest("tool_choice requires tools", "tool_choice")
        fmt = self.response_format
        if fmt is not None and fmt.type == "json_schema" and (fmt.json_schema is None or fmt.json_schema.schema is None):
            raise InvalidRequest("response_format json_schema requires json_schema.schema", "response_format")

    def _check_tools(self) -> None:
        names: set[str] = set()
        for i, tool in enumerate(self.tools or ()):
            name = tool.function.name
            if not _FUNCTION_NAME.fullmatch(name):
                raise InvalidRequest(f"tools[{i}].function.name {name!r} must be 1-64 letters, digits, "
                                     "underscores or dashes", f"tools[{i}].function.name")
            if name in names:
                raise InvalidRequest(f"tools[{i}]: another tool is already named {name!r}", f"tools[{i}].function.name")
            names.add(name)

    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(RequestFields, kw_only=True, omit_defaults=True):
    # A string, a list of strings, one prompt as token ids, or a list of token-id prompts.
    prompt: Union[str, list[Union[str, int, list[int]]]]
    logprobs: Annotated[int, Meta(ge=0, le=20)] | None = None
    echo: bool | None = False
    best_of: int | None = None
    suffix: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        self.echo = bool(self.echo)

    def validate(self) -> None:
        self._validate_common()
        if self.max_tokens == 0 and not self.echo:
            raise InvalidRequest("max_tokens must be at least 1 (0 only with echo, to score the prompt)", "max_tokens")
        if isinstance(self.prompt, list):
            if len(self.prompt) == 0:
                raise InvalidRequest("prompt must not be empty", "prompt")
            kinds = {type(x) for x in self.prompt}
            if len(kinds) > 1:
                raise InvalidRequest("prompt must be a string, a list of strings, a list of token ids "
                                     "or a list of token-id lists, not a mixture", "prompt")

    def prompts(self) -> list[str] | list[list[int]]:
        """The prompt normalised to a list (several prompts, each text or token ids)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]  # one tokenised prompt
        return list(p)

    def token_limit(self) -> int | None:
        return self.max_tokens

    def choices(self) -> int:
        """n choices for each prompt."""
        return (self.n or 1) * prompt_count(self.prompt)


class EmbeddingRequest(Struct, kw_only=True, omit_defaults=True):
    """POST /v1/embeddings. Only what the gateway checks; the body goes to the engine as it came."""

    model: Annotated[str, Meta(min_length=1)]
    # A string, strings, token ids or lists of token ids, as OpenAI takes them.
    input: Union[str, list[Union[str, int, list[int]]]]
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: Annotated[int, Meta(ge=1)] | None = None
    user: str | None = None

    def validate(self) -> None:
        if self.input == "" or self.input == [] or (isinstance(self.input, list)
                                                    and any(item in ("", []) for item in self.input)):
            raise InvalidRequest("input: must not be empty (nor hold an empty string or token list)", param="input")
        if isinstance(self.input, list) and len({type(item) for item in self.input}) > 1:
            raise InvalidRequest("input: a string, a list of strings, a list of token ids or a list of such lists, "
                                 "not a mix", param="input")


class Embedding(Struct):
    index: int
    embedding: Union[list[float], str]  # floats, or base64 of little-endian float32s (encoding_format)
    object: Literal["embedding"] = "embedding"


class EmbeddingUsage(Struct):
    prompt_tokens: int = 0
    total_tokens: int = 0


class EmbeddingList(Struct):
    """POST /v1/embeddings's answer, as the engine gave it (documented here, passed through unread)."""

    data: list[Embedding]
    model: str
    usage: EmbeddingUsage
    object: Literal["list"] = "list"


def prompt_count(prompt: Any) -> int:
    """How many prompts a completions ``prompt`` holds (one token-id list is one prompt)."""
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        return len(prompt)
    return 1


# ---------------------------------------------------------------- responses


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


class PromptTokensDetails(Struct):
    cached_tokens: int = 0  # prompt tokens served from a prefix cache or a forked context, not computed


class Usage(Struct):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0
    prompt_tokens_details: PromptTokensDetails | None = None


class TopLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None


class TokenLogprob(Struct):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob] = field(default_factory=list)


class ChoiceLogprobs(Struct):
    content: list[TokenLogprob] | None = None


class ResponseMessage(Struct):
    role: str = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(Struct):
    index: int
    message: ResponseMessage
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: str | None = None  # as vLLM answers: the stop string that ended the choice (None: another end)


def served_tier(asked: str | None) -> str:
    """The service tier an answer reports: the one asked for, ``auto`` (or none) being the default one."""
    return asked if asked not in (None, "auto") else "default"


class ChatCompletion(Struct):
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    id: str = field(default_factory=lambda: new_id("chatcmpl"))
    object: str = "chat.completion"
    created: int = field(default_factory=now)
    service_tier: str | None = None


class ToolCallDelta(Struct, omit_defaults=True):
    index: int
    id: str | None = None
    type: str | None = None
    function: dict[str, str] | None = None


class ChatDelta(Struct, omit_defaults=True):
    role: str | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(Struct):
    index: int
    delta: ChatDelta
    finish_reason: str | None = None
    logprobs: ChoiceLogprobs | None = None
    stop_reason: str | None = None


class ChatCompletionChunk(Struct):
    model: str
    choices: list[ChatChunkChoice]
    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    service_tier: str | None = None
    usage: Usage | None = None


class CompletionLogprobs(Struct):
    tokens: list[str] = field(default_factory=list)
    # None for an echoed prompt's first token, which nothing precedes (as OpenAI and vLLM answer).
    token_logprobs: list[float | None] = field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = field(default_factory=list)
    text_offset: list[int] = field(default_factory=list)


class CompletionChoice(Struct):
    index: int
    text: str
    finish_reason: str | None = None
    logprobs: CompletionLogprobs | None = None


class Completion(Struct):
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    id: str = field(default_factory=lambda: new_id("cmpl"))
    object: str = "text_completion"
    created: int = field(default_factory=now)


class ModelCard(Struct):
    id: str
    object: str = "model"
    created: int = field(default_factory=now)
    owned_by: str = "parrot"


class ModelList(Struct):
    data: list[ModelCard]
    object: str = "list"


class ErrorBody(Struct):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(Struct):
    error: ErrorBody


# ---------------------------------------------------------------- codecs


encoder = msgspec.json.Encoder()
chat_request_decoder = msgspec.json.Decoder(ChatCompletionRequest)
completion_request_decoder = msgspec.json.Decoder(CompletionRequest)
