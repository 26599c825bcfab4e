"""Anthropic Messages run over the chat-completions path: a request translated (gateway/translation/messages.py),
checked as a chat request, run through the Gateway under its key's quotas, and its answer (or stream)
translated back. Token counts are the engine's own: the prompt tokens of a one-token generation. With the
``parrot`` extension (an extra body field) the chat body is a semantic request of the chat path."""

from __future__ import annotations

from typing import Any, AsyncIterator, NamedTuple

import msgspec
from litestar import Response as HTTPResponse

from gateway.chat_path import ROUTE, check_chat, chunks_of, extension_of
from gateway.errors import body_error
from gateway.quotas import Quotas
from gateway.semantic.service import SemanticService
from gateway.service import Gateway
from gateway.translation.chat import completion_decoder
from gateway.translation.message_stream import MessageStream
from gateway.translation.messages import CHAT_PARAMS, message, to_chat
from wire.anthropic import CountTokensRequest, AnthropicMessage, MessagesRequest, TokenCount, AnthropicUsage

_KNOWN = frozenset(MessagesRequest.__struct_fields__) | {"parrot"}
# Anthropic's request fields without a chat-completions meaning: not sent to engines.
ANTHROPIC_ONLY = frozenset({"cache_control", "container", "context_management", "diagnostics", "inference_geo",
                            "mcp_servers", "speed", "user_profile_id", "workspace_id", "betas"})
_count_decoder = msgspec.json.Decoder(CountTokensRequest)


def echo_tier(asked: str | None) -> str:
    """Anthropic's usage.service_tier: "priority" when asked for it, else "standard"."""
    return "priority" if asked == "priority" else "standard"


class Prepared(NamedTuple):
    owner: str
    request: MessagesRequest
    chat: dict
    estimate: int
    parrot: dict[str, Any] | None = None  # the semantic-variable extension: run on the semantic path


def _decode(decoder: msgspec.json.Decoder, raw: bytes):
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise body_error(exc, raw) from None


class MessagesService:
    def __init__(self, gateway: Gateway, quotas: Quotas, semantic: SemanticService):
        self.gateway = gateway
        self.quotas = quotas
        self.semantic = semantic

    def prepare(self, raw: bytes, owner: str) -> Prepared:
        try:
            body = msgspec.json.decode(raw)
            request = msgspec.convert(body, MessagesRequest)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise body_error(exc, raw) from None
        chat = to_chat(request)
        # Fields this API does not know go to the engine, as on the chat path (vLLM's sampling extras);
        # Anthropic's own that have no meaning there do not.
        chat.update((name, value) for name, value in body.items()
                    if name not in _KNOWN and name not in ANTHROPIC_ONLY and name not in chat)
        checked = check_chat(self.gateway, chat, CHAT_PARAMS, "messages")
        parrot = extension_of(body)
        # A semantic request's usage is charged by its call, which may outlive this response (as on the chat path).
        estimate = 0 if parrot is not None else self.gateway.max_request_tokens(checked) or 0
        return Prepared(owner, request, chat, estimate, parrot)

    async def create(self, prepared: Prepared) -> AnthropicMessage | HTTPResponse:
        """The message; a semantic request with ``parrot.wait`` false is answered 202 at once, as on the chat path."""
        parrot = msgspec.UNSET
        async with self.quotas.admitted(prepared.owner, prepared.estimate):
            if prepared.parrot is not None:
                submitted = await self.semantic.submit(ROUTE, prepared.parrot, prepared.chat, prepared.owner, False)
                answered = await self.semantic.answer(submitted)
                if not submitted.wait:
                    return answered
                body, parrot = answered.content, msgspec.to_builtins(submitted.result)
            else:
                body = (await self.gateway.create(ROUTE, prepared.request.model, prepared.chat)).body
        answer = message(prepared.request, completion_decoder.decode(body), echo_tier(prepared.request.service_tier))
        answer.parrot = parrot
        return answer

    async def stream(self, prepared: Prepared) -> AsyncIterator[bytes]:
        """The message's SSE events; the first once the engine's stream has started."""
        request = prepared.request
        writer = MessageStream(AnthropicMessage(model=request.model, usage=AnthropicUsage(service_tier=echo_tier(request.service_tier))),
                               request.stop_sequences)
        async with self.quotas.admitted(prepared.owner, prepared.estimate):
            if prepared.parrot is not None:
                submitted = await self.semantic.submit(ROUTE, prepared.parrot, prepared.chat, prepared.owner, True)
                writer.message.parrot = msgspec.to_builtins(submitted.result)  # in message_start
                events = (await self.semantic.answer(submitted)).iterator  # once its first text is generated
            else:
                events = self.gateway.sse_events(request.model,
                                                 await self.gateway.open_stream(ROUTE, request.model, prepared.chat))
            yield writer.start()
            stream = chunks_of(events)
            try:
                async for chunk in stream:
                    if chunk.error is not None:
                        yield writer.fail(chunk.error.message)
                        return
                    out = writer.feed(chunk)
                    if out:
                        yield out
            finally:
                await stream.aclose()
            yield writer.finish()

    async def count_tokens(self, raw: bytes, owner: str) -> TokenCount:
        request: CountTokensRequest = _decode(_count_decoder, raw)
        chat = to_chat(request)
        check_chat(self.gateway, chat, CHAT_PARAMS, "messages")
        async with self.quotas.admitted(owner, 1):
            answer = await self.gateway.create(ROUTE, request.model, chat)
        usage = completion_decoder.decode(answer.body).usage
        return TokenCount(input_tokens=usage.prompt_tokens if usage is not None else 0)
