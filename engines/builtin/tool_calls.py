"""Tool calls out of the output: the tools grammar's text read back into OpenAI ``tool_calls``,
incrementally, so streaming and non-streaming responses come from the same code."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field

from engines.builtin.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN
from wire.openai import FunctionCall, ToolCall, ToolCallDelta


_CALL_HEAD = re.compile(r'\s*' + re.escape(TOOL_CALL_OPEN) + r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')
_CALL_TAIL = re.compile(r"\s*\}\s*" + re.escape(TOOL_CALL_CLOSE))


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

    calls: list[ToolCall] = field(default_factory=list)
    _buffer: str = ""
    _mode: str | None = None  # None until the first character: "content" or "calls"
    _arguments: _Arguments | None = None  # the call whose arguments are streaming

    def feed(self, text: str) -> tuple[str, list[ToolCallDelta]]:
        """Adds output text; returns the content and the tool-call deltas it releases."""
        self._buffer += text
        start = self._buffer.lstrip()
        if self._mode is None and start and not TOOL_CALL_OPEN.startswith(start):  # else: too early to tell
            self._mode = "calls" if start.startswith(TOOL_CALL_OPEN) else "content"
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
        if not stripped or self._arguments is not None or self._mode == "calls" or TOOL_CALL_OPEN.startswith(stripped):
            return ""
        return leftover

    def _step(self, deltas: list[ToolCallDelta]) -> bool:
        """Consumes what it can of the buffer; returns whether to try again."""
        if self._arguments is None:
            head = _CALL_HEAD.match(self._buffer)
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
        tail = _CALL_TAIL.match(self._buffer)
        if tail is None:
            return False
        self._buffer = self._buffer[tail.end() :]
        self._arguments = None
        return True


def read_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """A whole tools-grammar output as (content, tool calls)."""
    reader = ToolCallReader()
    content, _ = reader.feed(text)
    content += reader.finish()
    return (content if content or not reader.calls else None), reader.calls
