"""OpenAI's Responses API over chat completions: a request's conversation (earlier turns' items, its
instructions, its input) as a chat body, and a chat completion back as the response's output items,
status and usage. The stream's events are response_stream.py's."""

from __future__ import annotations

from typing import Any, Callable

import msgspec

from gateway.translation.chat import Completion, cached_tokens, chat_body
from wire.errors import InvalidRequest
from wire.openai import Usage
from wire.responses import (
    FunctionCallItem,
    FunctionCallOutputItem,
    FunctionTool,
    IncompleteDetails,
    InputImage,
    InputText,
    InputTokensDetails,
    Item,
    ItemReference,
    MessageItem,
    NamedFunction,
    OutputItem,
    OutputText,
    ReasoningItem,
    ResponsesRequest,
    ResponseUsage,
    ToolChoice,
    input_item,
    new_item_id,
    part_text,
)

# The chat fields a Responses request's errors are about, as the Responses API names them.
CHAT_PARAMS = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
               "response_format": "text.format", "messages": "input"}


def input_items(request: ResponsesRequest, max_items: int) -> list[Item]:
    """The request's input as items (a string is one user message), each checked and given an id."""
    if isinstance(request.input, str):
        return [MessageItem(role="user", content=request.input, id=new_item_id("msg"))]
    if len(request.input) > max_items:
        raise InvalidRequest(f"input holds {len(request.input)} items, above this server's limit of {max_items}",
                             "input")
    items = []
    for i, raw in enumerate(request.input):
        item = input_item(raw, f"input[{i}]")
        if item.id is None and not isinstance(item, ItemReference):
            item.id = new_item_id({MessageItem: "msg", FunctionCallItem: "fc", FunctionCallOutputItem: "fco",
                                   ReasoningItem: "rs"}[type(item)])
        items.append(item)
    return items


def resolve_references(items: list[Item], earlier: list[Item]) -> list[Item]:
    """``item_reference`` items replaced by the earlier item of that id (400 naming it if there is none)."""
    by_id = {item.id: item for item in earlier if not isinstance(item, ItemReference) and item.id}
    resolved = []
    for i, item in enumerate(items):
        if isinstance(item, ItemReference):
            if item.id not in by_id:
                raise InvalidRequest(f"input[{i}].id: no item {item.id!r} in this conversation", f"input[{i}].id")
            item = by_id[item.id]
        resolved.append(item)
    return resolved


def texts_changed(items: list[Item], change: Callable[[str], str]) -> list[Item]:
    """``items`` with ``change`` applied to each text a placeholder may sit in: the texts their chat messages
    hold (a message's text, a function call's output), as ``wire.placeholders.map_texts`` changes those."""
    changed: list[Item] = []
    for item in items:
        if isinstance(item, MessageItem):
            item = msgspec.structs.replace(item, content=_parts_changed(item.content, change))
        elif isinstance(item, FunctionCallOutputItem):
            item = msgspec.structs.replace(item, output=_parts_changed(item.output, change))
        changed.append(item)
    return changed


def _parts_changed(content: Any, change: Callable[[str], str]) -> Any:
    if isinstance(content, str):
        return change(content)
    return [msgspec.structs.replace(part, text=change(part.text)) if isinstance(part, (InputText, OutputText))
            else part for part in content]


def function_tools(request: ResponsesRequest) -> list[FunctionTool]:
    tools = []
    names: set[str] = set()
    for i, raw in enumerate(request.tools or ()):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind != "function":
            raise InvalidRequest(f"tools[{i}].type: only function tools are served here, not {kind!r}",
                                 f"tools[{i}].type")
        try:
            tool = msgspec.convert(raw, FunctionTool)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"tools[{i}]: {exc}", f"tools[{i}]") from None
        if tool.name in names:
            raise InvalidRequest(f"tools[{i}]: another tool is already named {tool.name!r}", f"tools[{i}].name")
        names.add(tool.name)
        tools.append(tool)
    return tools


def tool_choice(request: ResponsesRequest, tools: list[FunctionTool]) -> ToolChoice:
    choice = request.tool_choice
    if choice is None:
        return "auto"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise InvalidRequest("tool_choice must be 'none', 'auto', 'required' or a function", "tool_choice")
        if choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs tools", "tool_choice")
        return choice  # type: ignore[return-value]
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise InvalidRequest("tool_choice: only {\"type\": \"function\", \"name\": ...} names a tool here",
                             "tool_choice")
    if choice["name"] not in {tool.name for tool in tools}:
        raise InvalidRequest(f"tool_choice names {choice['name']!r}, which is not among the tools",
                             "tool_choice.name")
    return NamedFunction(name=choice["name"])


def _content(content: Any) -> str | list[dict[str, Any]]:
    if isinstance(content, str) or not any(isinstance(p, InputImage) for p in content):
        return part_text(content)
    parts = []
    for part in content:
        if isinstance(part, InputImage):
            parts.append({"type": "image_url", "image_url": {"url": part.image_url or ""}})
        elif not isinstance(part, str) and hasattr(part, "text"):
            parts.append({"type": "text", "text": part.text})
    return parts


def chat_messages(instructions: str | None, conversation: list[Item]) -> list[dict[str, Any]]:
    """The conversation as chat messages: an assistant's text and the calls after it one message,
    each call's output a tool message, reasoning skipped."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions else []
    for item in conversation:
        if isinstance(item, MessageItem):
            role = "system" if item.role == "developer" else item.role
            messages.append({"role": role, "content": _content(item.content)})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            output = item.output if isinstance(item.output, str) else part_text(item.output)
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
    return messages


def _response_format(request: ResponsesRequest) -> dict[str, Any] | None:
    fmt = request.text.format if request.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema is None:
        raise InvalidRequest("text.format json_schema requires a schema", "text.format.schema")
    schema: dict[str, Any] = {"name": fmt.name or "response", "schema": fmt.schema}
    if fmt.strict is not None:
        schema["strict"] = fmt.strict
    if fmt.description is not None:
        schema["description"] = fmt.description
    return {"type": "json_schema", "json_schema": schema}


def _chat_tool_choice(choice: ToolChoice) -> Any:
    return {"type": "function", "function": {"name": choice.name}} if isinstance(choice, NamedFunction) else choice


def to_chat(request: ResponsesRequest, conversation: list[Item], tools: list[FunctionTool],
            choice: ToolChoice) -> dict[str, Any]:
    """The chat completions body that runs ``request`` over ``conversation`` (earlier turns and its input)."""
    messages = chat_messages(request.instructions, conversation)
    if not messages:
        raise InvalidRequest("input: the request has nothing to answer (no input, no instructions)", "input")
    chat_tools = [{"type": "function", "function": msgspec.to_builtins(tool)} for tool in tools] or None
    for tool in chat_tools or ():
        tool["function"].pop("type", None)
    return chat_body(
        messages, model=request.model, max_tokens=request.max_output_tokens, temperature=request.temperature,
        top_p=request.top_p, user=request.user, service_tier=request.service_tier, tools=chat_tools,
        tool_choice=_chat_tool_choice(choice) if tools else None,
        parallel_tool_calls=request.parallel_tool_calls if tools else None,
        response_format=_response_format(request),
        stream=True if request.stream else None,
        stream_options={"include_usage": True} if request.stream else None)


def usage(chat: Usage | None) -> ResponseUsage | None:
    if chat is None:
        return None
    return ResponseUsage(input_tokens=chat.prompt_tokens, output_tokens=chat.completion_tokens,
                         total_tokens=chat.total_tokens or chat.prompt_tokens + chat.completion_tokens,
                         input_tokens_details=InputTokensDetails(cached_tokens=cached_tokens(chat)))


def incomplete(finish_reason: str | None) -> IncompleteDetails | None:
    """Why a response stopped short: ``length`` is its max_output_tokens."""
    if finish_reason == "length":
        return IncompleteDetails(reason="max_output_tokens")
    if finish_reason == "content_filter":
        return IncompleteDetails(reason="content_filter")
    return None


def output_items(completion: Completion) -> list[OutputItem]:
    """The first choice as output items: its text a message, then each tool call a function_call."""
    if not completion.choices:
        return []
    choice = completion.choices[0]
    status = "incomplete" if choice.finish_reason == "length" else "completed"
    items: list[OutputItem] = []
    if choice.message.content:
        items.append(MessageItem(role="assistant", id=new_item_id("msg"), status=status,
                             content=[OutputText(text=choice.message.content)]))
    for call in choice.message.tool_calls or ():
        items.append(FunctionCallItem(id=new_item_id("fc"), call_id=call.id or new_item_id("call"),
                                  name=call.function.name or "", arguments=call.function.arguments or "",
                                  status="completed"))
    return items
