"""Anthropic Messages run over the chat-completions path: a request translated (gateway/translation/messages.py),
checked as a chat request, run through the Gateway under its key's quotas, and its answer (or stream)
translated back. Token counts are the engine's own: the prompt tokens of a one-token generation."""

from __future__ import annotations

from typing import AsyncIterator, NamedTuple

import msgspec

from gateway.chat_path import ROUTE, check_chat, chunks
from gateway.errors import body_error
from gateway.quotas import Quotas
from gateway.service import Gateway
from gateway.translation.chat import completion_decoder
from gateway.translation.message_stream import MessageStream
from gateway.translation.messages import CHAT_PARAMS, message, to_chat
from wire.anthropic import CountTokensRequest, AnthropicMessage, MessagesRequest, TokenCount, AnthropicUsage

_KNOWN = frozenset(MessagesRequest.__struct_fields__)
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


def _decode(decoder: msgspec.json.Decoder, raw: bytes):
    try:
        return decoder.decode(raw)
    except (msgspec.DecodeError, UnicodeDecodeError) as exc:
        raise body_error(exc, raw) from None


class MessagesService:
    def __init__(self, gateway: Gateway, quotas: Quotas):
        self.gateway = gateway
        self.quotas = quotas

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
        return Prepared(owner, request, chat, self.gateway.max_request_tokens(checked) or 0)

    async def create(self, prepared: Prepared) -> AnthropicMessage:
        async with self.quotas.admitted(prepared.owner, prepared.estimate):
            answer = await self.gateway.create(ROUTE, prepared.request.model, prepared.chat)
        return message(prepared.request, completion_decoder.decode(answer.body), echo_tier(prepared.request.service_tier))

    async def stream(self, prepared: Prepared) -> AsyncIterator[bytes]:
        """The message's SSE events; the first once the engine's stream has started."""
        request = prepared.request
        writer = MessageStream(AnthropicMessage(model=request.model, usage=AnthropicUsage(service_tier=echo_tier(request.service_tier))),
                               request.stop_sequences)
        async with self.quotas.admitted(prepared.owner, prepared.estimate):
            opened = await self.gateway.open_stream(ROUTE, request.model, prepared.chat)
            yield writer.start()
            stream = chunks(self.gateway, request.model, opened)
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
