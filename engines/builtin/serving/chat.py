"""POST /v1/chat/completions on the builtin engine: chat templates, tools, structured output, streaming."""

from __future__ import annotations

from typing import AsyncIterator

import msgspec

from engines.builtin.tool_calls import ToolCallReader, read_tool_calls
from engines.builtin.grammar import output_grammar
from engines.builtin.tool_prompt import ToolCallSyntax, tool_call_syntax, tool_messages
from engines.builtin.tokenizer import chat_prompt_text, chat_prompt_tokens
from wire.errors import InvalidRequest
from wire.openai import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessage,
    ResponseMessage,
    Tool,
    Usage,
    encoder,
    new_id,
    now,
    served_tier,
)
from engines.builtin.serving.errors import EngineBadRequest
from engines.builtin.serving.choices import Piece, PromptJob, UsageCount, usage
from engines.builtin.serving.model_serving import ModelServing, validate_request
from engines.builtin.serving.sampling import per_choice


class ChatCompletions(ModelServing):

    async def create(self, request: ChatCompletionRequest) -> ChatCompletion:
        job = self._job(request)
        results = await self.collect([job])
        choices = []
        for i, r in enumerate(results):
            message, finish_reason = ResponseMessage(content=r.text), r.finish_reason
            if job.tool_calls:
                content, calls = read_tool_calls(r.text, self.tool_syntax)
                message = ResponseMessage(content=content, tool_calls=calls or None)
                finish_reason = _tool_finish_reason(finish_reason, calls)
            logprobs = self.logprobs.chat(r.events) if request.logprobs else None
            choices.append(ChatChoice(index=i, message=message, finish_reason=finish_reason, logprobs=logprobs,
                                      stop_reason=r.stop_reason))
        return ChatCompletion(model=self.model_name, choices=choices, usage=usage([job], results),
                              service_tier=served_tier(request.service_tier))

    async def stream(self, request: ChatCompletionRequest) -> AsyncIterator[bytes]:
        """The response's chunks, encoded (SSE framing is the caller's)."""
        job = self._job(request)
        chunk_id, created, tier = new_id("chatcmpl"), now(), served_tier(request.service_tier)

        def chunk(choices: list[ChatChunkChoice], usage: Usage | None = None) -> bytes:
            return encoder.encode(
                ChatCompletionChunk(model=self.model_name, choices=choices, id=chunk_id, created=created, usage=usage,
                                    service_tier=tier)
            )

        for index in job.indices:
            yield chunk([ChatChunkChoice(index, ChatDelta(role="assistant", content=""))])
        count = UsageCount([job])
        readers = {index: ToolCallReader(self.tool_syntax) for index in job.indices} if job.tool_calls else None
        async for index, piece in self.run_all([job]):
            count.add(index, piece.token_ids, piece.events)
            logprobs = self.logprobs.chat(piece.events) if request.logprobs else None
            delta, finish_reason = ChatDelta(content=piece.text), piece.finish_reason
            if readers is not None:
                delta, finish_reason = _tool_delta(readers[index], piece)
                if delta.content is None and delta.tool_calls is None and finish_reason is None and logprobs is None:
                    continue  # text held back until it is known to be (part of) a call
            yield chunk([ChatChunkChoice(index, delta, finish_reason, logprobs, piece.stop_reason)])
        if request.stream_options is not None and request.stream_options.include_usage:
            yield chunk([], count.usage())

    @property
    def tool_syntax(self) -> ToolCallSyntax:
        """The model family's own tool-call syntax where its chat template teaches one, else Hermes'."""
        return tool_call_syntax(getattr(self.tokenizer, "chat_template", None))

    def _with_tools(self, messages: list[ChatMessage], tools: list[Tool] | None) -> list[ChatMessage]:
        return tool_messages(messages, tools, getattr(self.tokenizer, "chat_template", None))

    def render_chat(self, messages: list[ChatMessage], tools: list[Tool] | None = None) -> str:
        """The prompt text a chat request becomes here, tool descriptions included (gateways split it
        at variable boundaries to share prefixes)."""
        return chat_prompt_text(self.tokenizer, self._with_tools(messages, tools), tools)

    def prompt_tokens(self, messages: list[ChatMessage], tools: list[Tool] | None = None) -> list[int]:
        """The token ids a chat request's prompt is here (POST /tokenize)."""
        return chat_prompt_tokens(self.tokenizer, self._with_tools(messages, tools), tools)

    def _job(self, request: ChatCompletionRequest) -> PromptJob:
        validate_request(request)
        _check_text_only(request.messages, self.model_name)
        try:
            output = output_grammar(request.response_format, request.tools, request.tool_choice, request.parallel_tool_calls,
                                    self.tool_syntax)
        except InvalidRequest as exc:
            raise EngineBadRequest(str(exc), exc.param) from exc
        # Offered even with tool_choice "none" (the grammar keeps calls out), as OpenAI and vLLM do.
        tokens = chat_prompt_tokens(self.tokenizer, self._with_tools(request.messages, request.tools), request.tools)
        params = self.sampling_params(
            request, len(tokens), logprobs=request.logprobs, top_logprobs=request.top_logprobs or 0, prompt_param="messages"
        )
        params = msgspec.structs.replace(params, grammar=output.grammar)
        return PromptJob(tokens, per_choice(params, request.n), 0, request.stop_list(), output.tool_calls)


def _tool_finish_reason(finish_reason: str | None, calls: list) -> str | None:
    return "tool_calls" if calls and finish_reason == "stop" else finish_reason


def _tool_delta(reader: ToolCallReader, piece: Piece) -> tuple[ChatDelta, str | None]:
    """One streamed piece of a tools-grammar output as content and/or tool-call deltas."""
    content, calls = reader.feed(piece.text)
    if piece.finish_reason is not None:
        content += reader.finish()
    return ChatDelta(content=content or None, tool_calls=calls or None), _tool_finish_reason(piece.finish_reason, reader.calls)


def _check_text_only(messages: list[ChatMessage], model: str) -> None:
    """Images, audio and files would be dropped unseen: refused instead, as OpenAI refuses them for a
    model without that modality."""
    for i, message in enumerate(messages):
        for j, part in enumerate(message.content if isinstance(message.content, list) else ()):
            if part.type in ("image_url", "input_audio", "file"):
                raise EngineBadRequest(f"model {model!r} takes text only; messages[{i}].content[{j}] is a part "
                                       f"of type {part.type}", f"messages[{i}].content[{j}]")
