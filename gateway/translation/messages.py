"""Anthropic's Messages API over chat completions: a request as a chat body (system, content blocks,
tool_use as tool calls, each tool_result a tool message, tool_choice, stop_sequences), and a chat completion
back as a message (text and tool_use blocks, stop_reason, usage with the cache's reads apart). The stream's
events are message_stream.py's."""

from __future__ import annotations

import json
from typing import Any

from gateway.translation.chat import Completion, cached_tokens, chat_body
from wire.anthropic import (
    CountTokensRequest,
    ImageBlock,
    AnthropicMessage,
    MessagesRequest,
    AnthropicStopReason,
    TextBlock,
    TextContent,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseContent,
    AnthropicUsage,
)
from wire.errors import InvalidRequest
from wire.openai import Usage as ChatUsage

# The chat fields a Messages request's errors are about, as the Messages API names them.
CHAT_PARAMS = {"max_tokens": "max_tokens", "stop": "stop_sequences", "tools": "tools", "tool_choice": "tool_choice",
               "response_format": "output_config.format"}


def _image(block: ImageBlock) -> dict[str, Any]:
    source = block.source
    url = source.url if source.type == "url" else f"data:{source.media_type};base64,{source.data}"
    return {"type": "image_url", "image_url": {"url": url or ""}}


def _parts(blocks: list[Any]) -> str | list[dict[str, Any]]:
    """Text and image blocks as chat content: a string when they are all text."""
    if all(isinstance(b, TextBlock) for b in blocks):
        return "".join(b.text for b in blocks)
    return [{"type": "text", "text": b.text} if isinstance(b, TextBlock) else _image(b) for b in blocks]


def _tool_result(block: ToolResultBlock) -> dict[str, Any]:
    content = block.content if isinstance(block.content, str) else _parts(list(block.content))
    if isinstance(content, list):  # tool messages hold text
        content = "".join(p.get("text", "") for p in content)
    return {"role": "tool", "tool_call_id": block.tool_use_id,
            "content": f"Error: {content}" if block.is_error else content}


def chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    system = request.system if isinstance(request.system, str) or request.system is None else "".join(
        b.text for b in request.system)
    if system:
        messages.append({"role": "system", "content": system})
    for i, message in enumerate(request.messages):
        if isinstance(message.content, str):
            messages.append({"role": message.role, "content": message.content})
            continue
        shown = [b for b in message.content if isinstance(b, (TextBlock, ImageBlock))]
        if message.role == "user":
            messages.extend(_tool_result(b) for b in message.content if isinstance(b, ToolResultBlock))
            if shown or not any(isinstance(b, ToolResultBlock) for b in message.content):
                messages.append({"role": "user", "content": _parts(shown)})
            continue
        for j, block in enumerate(message.content):
            if isinstance(block, ToolResultBlock):
                raise InvalidRequest(f"messages[{i}].content[{j}]: tool_result blocks belong in user messages",
                                     f"messages[{i}].content[{j}].type")
        calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
                 for b in message.content if isinstance(b, ToolUseBlock)]
        text = "".join(b.text for b in shown if isinstance(b, TextBlock))
        assistant: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else "")}
        if calls:
            assistant["tool_calls"] = calls
        messages.append(assistant)
    return messages


def _tools(request: CountTokensRequest) -> list[dict[str, Any]] | None:
    tools = []
    for i, tool in enumerate(request.tools or ()):
        if tool.type not in (None, "custom"):
            raise InvalidRequest(f"tools[{i}].type: only client tools are served here, not {tool.type!r}",
                                 f"tools[{i}].type")
        if tool.input_schema is None:
            raise InvalidRequest(f"tools[{i}]: a tool needs its input_schema", f"tools[{i}].input_schema")
        function: dict[str, Any] = {"name": tool.name, "parameters": tool.input_schema}
        if tool.description is not None:
            function["description"] = tool.description
        tools.append({"type": "function", "function": function})
    return tools or None


def _tool_choice(request: CountTokensRequest) -> tuple[Any, bool | None]:
    choice = request.tool_choice
    if choice is None or not request.tools:
        if choice is not None and choice.type in ("any", "tool"):
            raise InvalidRequest("tool_choice requires tools", "tool_choice")
        return None, None
    parallel = False if choice.disable_parallel_tool_use else None
    if choice.type == "tool":
        if choice.name not in {t.name for t in request.tools}:
            raise InvalidRequest(f"tool_choice names {choice.name!r}, which is not among the tools", "tool_choice.name")
        return {"type": "function", "function": {"name": choice.name}}, parallel
    return {"auto": "auto", "any": "required", "none": "none"}[choice.type], parallel


def to_chat(request: CountTokensRequest) -> dict[str, Any]:
    """The chat completions body that runs ``request`` (a count_tokens one generates one token)."""
    choice, parallel = _tool_choice(request)
    fields: dict[str, Any] = dict(model=request.model, tools=_tools(request), tool_choice=choice,
                                  parallel_tool_calls=parallel)
    output = request.output_config.format if request.output_config is not None else None
    if output is not None:
        fields["response_format"] = {"type": "json_schema",
                                     "json_schema": {"name": "output", "schema": output.schema, "strict": True}}
    if isinstance(request, MessagesRequest):
        user = (request.metadata or {}).get("user_id")
        fields.update(max_tokens=request.max_tokens, stop=request.stop_sequences or None,
                      temperature=request.temperature, top_p=request.top_p, top_k=request.top_k,
                      user=user if isinstance(user, str) else None,
                      stream=True if request.stream else None,
                      stream_options={"include_usage": True} if request.stream else None)
    else:
        fields.update(max_tokens=1, temperature=0)
    return chat_body(chat_messages(request), **fields)


def usage(chat: ChatUsage | None, tier: str) -> AnthropicUsage:
    if chat is None:
        return AnthropicUsage(service_tier=tier)
    cached = cached_tokens(chat)
    return AnthropicUsage(input_tokens=chat.prompt_tokens - cached, output_tokens=chat.completion_tokens,
                 cache_read_input_tokens=cached, service_tier=tier)


def stop_reason(finish_reason: str | None, stopped_by: str | int | None,
                stop_sequences: list[str] | None) -> tuple[AnthropicStopReason | None, str | None]:
    """Anthropic's stop_reason and stop_sequence from a choice's finish and (where the engine says) the
    stop string that ended it."""
    if finish_reason == "tool_calls":
        return "tool_use", None
    if finish_reason == "length":
        return "max_tokens", None
    if isinstance(stopped_by, str) and stopped_by in (stop_sequences or ()):
        return "stop_sequence", stopped_by
    return ("end_turn", None) if finish_reason is not None else (None, None)


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's arguments as tool_use's ``input`` object (what is not an object kept under "arguments")."""
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return {"arguments": arguments}
    return value if isinstance(value, dict) else {"arguments": value}


def message(request: MessagesRequest, completion: Completion, tier: str) -> AnthropicMessage:
    answer = AnthropicMessage(model=request.model, usage=usage(completion.usage, tier))
    if not completion.choices:
        return answer
    choice = completion.choices[0]
    if choice.message.content:
        answer.content.append(TextContent(text=choice.message.content))
    for call in choice.message.tool_calls or ():
        answer.content.append(ToolUseContent(id=call.id or f"toolu_{len(answer.content)}", name=call.function.name or "",
                                             input=tool_input(call.function.arguments or "")))
    answer.stop_reason, answer.stop_sequence = stop_reason(choice.finish_reason, choice.stop_reason,
                                                           request.stop_sequences)
    return answer
