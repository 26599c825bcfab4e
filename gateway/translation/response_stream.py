"""A chat completion stream as the Responses API streams it: ``response.created`` and ``.in_progress``, then
for the text an output message (``output_item.added``, ``content_part.added``, ``output_text.delta``s,
``output_text.done``, ``content_part.done``, ``output_item.done``) and for each tool call a function_call item
(``output_item.added``, ``function_call_arguments.delta``s and ``.done``, ``output_item.done``, each item done
before the next one is added), and last
``response.completed`` (``.incomplete`` at max_output_tokens, ``.failed`` when the engine failed) with the
usage and its cached tokens. Every event is numbered (``sequence_number``)."""

from __future__ import annotations

from gateway.translation.chat import Chunk
from gateway.translation.responses import incomplete, usage
from wire.responses import (
    ArgumentsDeltaEvent,
    ArgumentsDoneEvent,
    ContentPartEvent,
    FunctionCallItem,
    MessageItem,
    OutputItemEvent,
    OutputText,
    Response,
    ResponseError,
    ResponseEvent,
    StreamEvent,
    TextDeltaEvent,
    TextDoneEvent,
    new_item_id,
    sse,
)


class ResponseStream:
    """Feeds on chat chunks, gives SSE bytes; ``response`` is the response as it stands (whole once
    ``finish`` has run, so the caller stores it before sending the last event)."""

    def __init__(self, response: Response):
        self.response = response
        self._sequence = 0
        self._text: MessageItem | None = None  # the open message item
        self._text_index = -1
        self._calls: dict[int, tuple[int, FunctionCallItem]] = {}  # chat tool-call index -> (output index, item)
        self._open_calls: list[int] = []
        self.finish_reason: str | None = None

    def _event(self, event: StreamEvent) -> bytes:
        self._sequence += 1
        return sse(event)

    def _seq(self) -> int:
        return self._sequence

    def start(self) -> bytes:
        snapshot = self.response
        return (self._event(ResponseEvent(type="response.created", sequence_number=self._seq(), response=snapshot))
                + self._event(ResponseEvent(type="response.in_progress", sequence_number=self._seq(),
                                            response=snapshot)))

    def feed(self, chunk: Chunk) -> bytes:
        out = []
        if chunk.usage is not None:
            self.response.usage = usage(chunk.usage)
        for choice in chunk.choices[:1]:
            delta = choice.delta
            if delta.content:
                out.append(self._text_delta(delta.content))
            for call in delta.tool_calls or ():
                out.append(self._call_delta(call.index, call.id, call.function.name, call.function.arguments))
            if choice.finish_reason:
                self.finish_reason = choice.finish_reason
        return b"".join(out)

    def _text_delta(self, text: str) -> bytes:
        out = b""
        if self._text is None:
            self._text = MessageItem(role="assistant", id=new_item_id("msg"), status="in_progress", content=[])
            self._text_index = len(self.response.output)
            self.response.output.append(self._text)
            out += self._event(OutputItemEvent(type="response.output_item.added", sequence_number=self._seq(),
                                               output_index=self._text_index, item=self._text))
            out += self._event(ContentPartEvent(type="response.content_part.added", sequence_number=self._seq(),
                                                item_id=self._text.id, output_index=self._text_index,
                                                content_index=0, part=OutputText(text="")))
            self._text.content.append(OutputText(text=""))
        self._text.content[0].text += text
        return out + self._event(TextDeltaEvent(sequence_number=self._seq(), item_id=self._text.id,
                                                output_index=self._text_index, content_index=0, delta=text))

    def _close_text(self, status: str) -> bytes:
        message = self._text
        if message is None or message.status != "in_progress":
            return b""
        message.status = status
        part = message.content[0]
        return (self._event(TextDoneEvent(sequence_number=self._seq(), item_id=message.id,
                                          output_index=self._text_index, content_index=0, text=part.text))
                + self._event(ContentPartEvent(type="response.content_part.done", sequence_number=self._seq(),
                                               item_id=message.id, output_index=self._text_index, content_index=0,
                                               part=part))
                + self._event(OutputItemEvent(type="response.output_item.done", sequence_number=self._seq(),
                                              output_index=self._text_index, item=message)))

    def _call_delta(self, index: int, call_id: str | None, name: str | None, arguments: str | None) -> bytes:
        out = b""
        if index not in self._calls:
            # The text comes before the calls, and a call is done when the next one starts: items finish in order,
            # as OpenAI streams them (chat upstreams send one call's arguments after the other's).
            out += self._close_text("completed") + self._close_calls("completed")
            item = FunctionCallItem(id=new_item_id("fc"), call_id=call_id or new_item_id("call"), name=name or "",
                                arguments="", status="in_progress")
            self._calls[index] = (len(self.response.output), item)
            self._open_calls.append(index)
            self.response.output.append(item)
            out += self._event(OutputItemEvent(type="response.output_item.added", sequence_number=self._seq(),
                                               output_index=self._calls[index][0], item=item))
        at, item = self._calls[index]
        if name and not item.name:
            item.name = name
        if arguments:
            item.arguments += arguments
            out += self._event(ArgumentsDeltaEvent(sequence_number=self._seq(), item_id=item.id, output_index=at,
                                                   delta=arguments))
        return out

    def _close_calls(self, status: str) -> bytes:
        out = b""
        for index in self._open_calls:
            at, item = self._calls[index]
            item.status = status
            out += self._event(ArgumentsDoneEvent(sequence_number=self._seq(), item_id=item.id, output_index=at,
                                                  name=item.name, arguments=item.arguments))
            out += self._event(OutputItemEvent(type="response.output_item.done", sequence_number=self._seq(),
                                               output_index=at, item=item))
        self._open_calls = []
        return out

    def finish(self) -> bytes:
        """Closes the open items and settles the response's status; the caller stores the response, then
        sends ``last()``."""
        details = incomplete(self.finish_reason)
        status = "incomplete" if details is not None else "completed"
        out = self._close_text(status) + self._close_calls(status)
        self.response.status = status
        self.response.incomplete_details = details
        return out

    def fail(self, code: str, message: str) -> bytes:
        out = self._close_text("incomplete") + self._close_calls("incomplete")
        self.response.status = "failed"
        self.response.error = ResponseError(code=code, message=message)
        return out

    def last(self) -> bytes:
        kind = {"completed": "response.completed", "incomplete": "response.incomplete"}.get(
            self.response.status, "response.failed")
        return self._event(ResponseEvent(type=kind, sequence_number=self._seq(), response=self.response))
