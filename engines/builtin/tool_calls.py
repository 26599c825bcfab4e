"""Tool calls out of the output: the tools grammar's text read back into OpenAI ``tool_calls``,
incrementally, so streaming and non-streaming responses come from the same code. The text is in the model
family's own syntax (tool_prompt.ToolCallSyntax: Hermes' ``<tool_call>`` JSON, as Qwen's, Mistral's
``[TOOL_CALLS]`` list, Llama 3.1's bare JSON with ``parameters``)."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from engines.builtin.tool_prompt import HERMES, ToolCallSyntax
from wire.openai import FunctionCall, ToolCall, ToolCallDelta


def call_head(before: str, syntax: ToolCallSyntax) -> re.Pattern[str]:
    """A call's start up to its arguments' value: ``before`` (the syntax's start, or its separator), the call's
    opening, and the JSON's name member; group 1 is the name as JSON string content."""
    return re.compile(r"\s*" + re.escape(before.strip()) + r"\s*" + re.escape(syntax.open)
                      + r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"' + re.escape(syntax.arguments_key) + r'"\s*:\s*')


def call_tail(syntax: ToolCallSyntax) -> re.Pattern[str]:
    return re.compile(r"\s*\}\s*" + re.escape(syntax.close))


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class _Arguments:
    """Scans an arguments JSON value as it arrives, to know where it ends. Hand-written on purpose:
    the arguments stream out as their tokens arrive, and a JSON parser (``json.JSONDecoder.raw_decode``)
    reads only a complete value: trying it on the growing buffer at every token would be quadratic
    and still not say how much of a partial value is safe to release. Tracking string, escape and
    nesting state is all that is needed (the tools grammar has made the value valid JSON)."""

    depth: int = 0
    in_string: bool = False
    escaped: bool = False
    done: bool = False

    def scan(self, text: str) -> int:
        """How many characters of ``text`` belong to the value (all of them unless it ends inside)."""
        for i, ch in enumerate(text):
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.done = True
                    return i + 1
        return len(text)


@dataclass
class ToolCallReader:
    """Reads a tools-grammar output as it streams: either plain content, or tool calls as OpenAI
    deltas (first id, type and name with empty arguments, then argument fragments)."""

    syntax: ToolCallSyntax = HERMES
    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _mode: str | None = None  # None until the first character: "content" or "calls"
    _arguments: _Arguments | None = None  # the call whose arguments are streaming

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Adds output text; returns the content and the tool-call deltas it releases."""
        self._buffer += text
        start = self._buffer.lstrip()
        marker = self.syntax.marker
        if self._mode is None and start and not marker.startswith(start):  # else: too early to tell
            self._mode = "calls" if start.startswith(marker) else "content"
        if self._mode == "content":
            content, self._buffer = self._buffer, ""
            return content, []
        deltas: list[ToolCallDelta] = []
        while self._mode == "calls" and self._step(deltas):
            pass
        return "", deltas

    def finish(self) -> str:
        """The output ended: returns text that never became a call. Tool-call markup cut off (by
        max_tokens) is dropped: the model's call syntax is never a client's content."""
        leftover, self._buffer = self._buffer, ""
        stripped = leftover.strip()
        if not stripped or self._arguments is not None or self._mode == "calls" or self.syntax.marker.startswith(stripped):
            return ""
        return leftover

    def _step(self, deltas: list[ToolCallDelta]) -> bool:
        """Consumes what it can of the buffer; returns whether to try again."""
        if self._arguments is None:
            head = call_head(self.syntax.separator if self.calls else self.syntax.start, self.syntax).match(self._buffer)
            if head is None:
                return False
            self._buffer = self._buffer[head.end() :]
            name = json.loads(f'"{head.group(1)}"')
            call = ToolCall(id=new_call_id(), function=FunctionCall(name=name, arguments=""))
            self.calls.append(call)
            deltas.append(ToolCallDelta(len(self.calls) - 1, call.id, "function", {"name": call.function.name, "arguments": ""}))
            self._arguments = _Arguments()
            return True
        if not self._arguments.done:
            if self._arguments.depth == 0:
                self._buffer = self._buffer.lstrip()  # the space after "arguments": when it came with the value
            taken = self._arguments.scan(self._buffer)
            fragment, self._buffer = self._buffer[:taken], self._buffer[taken:]
            if fragment:
                self.calls[-1].function.arguments += fragment
                deltas.append(ToolCallDelta(len(self.calls) - 1, function={"arguments": fragment}))
            return self._arguments.done
        tail = call_tail(self.syntax).match(self._buffer)
        if tail is None:
            return False
        self._buffer = self._buffer[tail.end() :]
        self._arguments = None
        return True


def read_tool_calls(text: str, syntax: ToolCallSyntax = HERMES) -> tuple[str | None, list[ToolCall]]:
    """A whole tools-grammar output as (content, tool calls)."""
    reader = ToolCallReader(syntax)
    content, _ = reader.feed(text)
    content += reader.finish()
    return (content if content or not reader.calls else None), reader.calls
