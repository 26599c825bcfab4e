"""A chat completion stream as Anthropic's Messages API streams it: ``message_start``, then each content block
(``content_block_start``, its ``content_block_delta``s: ``text_delta`` for text, ``input_json_delta`` for a
tool_use's arguments as they come, ``content_block_stop``), ``message_delta`` with the stop reason and the
usage, ``message_stop``; an engine failing mid-stream ends it with an ``error`` event."""

from __future__ import annotations

from gateway.translation.chat import Chunk
from gateway.translation.messages import stop_reason, usage
from wire.anthropic import (
    ContentBlockDelta,
    ContentBlockStart,
    ContentBlockStop,
    AnthropicErrorDetail,
    AnthropicError,
    InputJsonDelta,
    AnthropicMessage,
    MessageDelta,
    MessageStart,
    MessageStop,
    StopDelta,
    TextContent,
    TextDelta,
    ToolUseContent,
    sse,
)


class MessageStream:
    def __init__(self, message: AnthropicMessage, stop_sequences: list[str] | None):
        self.message = message
        self._stop_sequences = stop_sequences
        self._block = -1  # the open block's index
        self._open: str | None = None  # "text", or the chat tool-call index of the open tool_use ("tool:N")
        self._finish: str | None = None
        self._stopped_by: str | int | None = None
        self._usage = message.usage

    def start(self) -> bytes:
        return sse(MessageStart(message=self.message))

    def _close(self) -> bytes:
        if self._open is None:
            return b""
        self._open = None
        return sse(ContentBlockStop(index=self._block))

    def _begin(self, kind: str, block: TextContent | ToolUseContent) -> bytes:
        out = self._close()
        self._block += 1
        self._open = kind
        return out + sse(ContentBlockStart(index=self._block, content_block=block))

    def feed(self, chunk: Chunk) -> bytes:
        out = b""
        if chunk.usage is not None:
            self._usage = usage(chunk.usage, self.message.usage.service_tier)
        for choice in chunk.choices[:1]:
            delta = choice.delta
            if delta.content:
                if self._open != "text":
                    out += self._begin("text", TextContent(text=""))
                out += sse(ContentBlockDelta(index=self._block, delta=TextDelta(text=delta.content)))
            for call in delta.tool_calls or ():
                kind = f"tool:{call.index}"
                if self._open != kind:
                    out += self._begin(kind, ToolUseContent(id=call.id or f"toolu_{self._block + 1}",
                                                            name=call.function.name or "", input={}))
                if call.function.arguments:
                    out += sse(ContentBlockDelta(index=self._block,
                                                 delta=InputJsonDelta(partial_json=call.function.arguments)))
            if choice.finish_reason:
                self._finish, self._stopped_by = choice.finish_reason, choice.stop_reason
        return out

    def finish(self) -> bytes:
        reason, sequence = stop_reason(self._finish or "stop", self._stopped_by, self._stop_sequences)
        return (self._close() + sse(MessageDelta(delta=StopDelta(stop_reason=reason, stop_sequence=sequence),
                                                 usage=self._usage))
                + sse(MessageStop()))

    def fail(self, message: str) -> bytes:
        return self._close() + sse(AnthropicError(error=AnthropicErrorDetail(type="api_error", message=message)))
