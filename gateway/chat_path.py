"""Other APIs' requests (Responses, Anthropic Messages) run as chat completions: the translated body checked
as a chat request is (its limits, its model), its errors named as the client's API names the field, its ``parrot``
object (the semantic path runs it then), and a stream's chunks read out of SSE events (an engine's, or a semantic
request's)."""

from __future__ import annotations

from typing import Any, AsyncIterator, Mapping

import msgspec

from gateway.domain_errors import DomainError, Invalid
from gateway.service import Gateway
from gateway.translation.chat import Chunk, ChunkReader
from wire.errors import InvalidRequest
from wire.openai import ChatCompletionRequest

ROUTE = "chat/completions"


def _renamed(exc: InvalidRequest | DomainError, names: Mapping[str, str], fallback: str) -> Exception:
    param = exc.param
    if param is None:
        return exc
    head, dot, rest = param.partition(".")
    name = names.get(head.partition("[")[0])
    exc.param = fallback if name is None else name + (dot + rest if dot and name != fallback else "")
    return exc


def check_chat(gateway: Gateway, chat: dict[str, Any], names: Mapping[str, str], fallback: str
               ) -> ChatCompletionRequest:
    """``chat`` checked as ``POST /v1/chat/completions`` checks a body (types, limits, the model served);
    an error's ``param`` renamed by ``names`` (chat field -> the client's), else ``fallback``."""
    try:
        checked = msgspec.convert(chat, ChatCompletionRequest)
        gateway.check(checked)
    except (InvalidRequest, Invalid) as exc:
        raise _renamed(exc, names, fallback) from None
    except msgspec.ValidationError as exc:
        raise Invalid(f"{fallback}: {exc}", param=fallback) from None
    return checked


def extension_of(body: dict[str, Any]) -> dict[str, Any] | None:
    """A body's ``parrot`` object (None: a plain request); the semantic path checks what it holds."""
    parrot = body.get("parrot")
    if parrot is not None and not isinstance(parrot, dict):
        raise Invalid("parrot must be an object (the semantic-variable extension)", param="parrot")
    return parrot


async def chunks_of(events: AsyncIterator[bytes]) -> AsyncIterator[Chunk]:
    """The chunks of a chat stream's SSE ``events`` (an engine's, or a semantic request's), which are closed
    when this is."""
    reader = ChunkReader()
    try:
        async for data in events:
            for chunk in reader.feed(data):
                yield chunk
    finally:
        aclose = getattr(events, "aclose", None)
        if aclose is not None:
            await aclose()
