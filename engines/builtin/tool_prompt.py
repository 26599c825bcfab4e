"""Tools in the prompt: the tool descriptions and earlier calls written the way the tools grammar makes
the model answer, Hermes-style ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (what
SmolLM2 and most open chat models are tuned on), for chat templates that do not render tools.

A template that renders tools itself tells the model its family's own call syntax (``ToolCallSyntax``): Qwen's
is Hermes', Mistral's ``[TOOL_CALLS][{...}, ...]``, Llama 3.1's a bare ``{"name": ..., "parameters": {...}}``.
The tools grammar (grammar.py) then makes the model write that syntax and tool_calls.py reads it back."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Sequence

from wire.openai import ChatMessage, Tool

TOOL_CALL_OPEN, TOOL_CALL_CLOSE = "<tool_call>", "</tool_call>"


@dataclass(frozen=True)
class ToolCallSyntax:
    """How a family writes tool calls: ``start`` call (``separator`` call)* ``end``, each call ``open`` JSON
    ``close``, the JSON ``{"name": ..., <arguments_key>: {...}}``."""

    name: str
    start: str
    open: str
    close: str
    separator: str
    end: str
    arguments_key: str = "arguments"

    @property
    def marker(self) -> str:
        """The text an output that is calls starts with (after whitespace)."""
        return self.start + self.open or '{"name": '


HERMES = ToolCallSyntax("hermes", "", TOOL_CALL_OPEN, TOOL_CALL_CLOSE, "\n", "")
MISTRAL = ToolCallSyntax("mistral", "[TOOL_CALLS][", "", "", ", ", "]")
# vLLM's llama3_json parser reads several calls separated by "; " (Llama 3.1's template asks for one).
LLAMA3_JSON = ToolCallSyntax("llama3_json", "", "", "", "; ", "", arguments_key="parameters")


def tool_call_syntax(chat_template: str | None) -> ToolCallSyntax:
    """The syntax the model's own template teaches when it renders tools, else Hermes' (tool_prompt's)."""
    template = chat_template or ""
    if not renders_tools(template):
        return HERMES
    if "[TOOL_CALLS]" in template:
        return MISTRAL
    if TOOL_CALL_OPEN not in template and '"parameters"' in template and "<|eot_id|>" in template:
        return LLAMA3_JSON
    return HERMES


def renders_tools(chat_template: str) -> bool:
    return "tools" in chat_template and "tool_calls" in chat_template


def tool_messages(messages: Sequence[ChatMessage], tools: Sequence[Tool] | None, chat_template: str | None) -> list[ChatMessage]:
    """The conversation as a template that does not render tools must see it: the tools described
    in the system message, and earlier assistant tool calls written out in the format the grammar
    enforces. Templates that render tools themselves get the messages unchanged."""
    if renders_tools(chat_template or ""):
        return list(messages)
    out = [_calls_as_text(m) if m.role == "assistant" and m.tool_calls else m for m in messages]
    if not tools:
        return out
    prompt = tool_prompt(tools)
    if out and out[0].role in ("system", "developer"):
        return [ChatMessage(role=out[0].role, content=f"{out[0].text()}\n\n{prompt}"), *out[1:]]
    return [ChatMessage(role="system", content=prompt), *out]


def tool_prompt(tools: Sequence[Tool]) -> str:
    lines = [json.dumps(_tool_dict(tool)) for tool in tools]
    return (
        "You can call these tools:\n<tools>\n" + "\n".join(lines) + "\n</tools>\n"
        f'To call a tool, reply with {TOOL_CALL_OPEN}{{"name": <tool name>, "arguments": <arguments object>}}'
        f"{TOOL_CALL_CLOSE}. Otherwise reply in plain text."
    )


def _tool_dict(tool: Tool) -> dict[str, Any]:
    fn = tool.function
    out: dict[str, Any] = {"name": fn.name}
    if fn.description:
        out["description"] = fn.description
    out["parameters"] = fn.parameters or {"type": "object", "properties": {}}
    return out


def _calls_as_text(message: ChatMessage) -> ChatMessage:
    calls = "\n".join(call_text(call.function.name, call.function.arguments) for call in message.tool_calls or ())
    text = message.text()
    return ChatMessage(role="assistant", content=f"{text}\n{calls}" if text else calls, name=message.name)


def call_text(name: str, arguments: str) -> str:
    try:
        args = json.dumps(json.loads(arguments or "{}"))
    except ValueError:
        args = json.dumps(arguments)
    return f'{TOOL_CALL_OPEN}{{"name": {json.dumps(name)}, "arguments": {args}}}{TOOL_CALL_CLOSE}'


