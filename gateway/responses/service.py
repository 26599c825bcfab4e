"""Responses run over the chat-completions path: a request checked and translated (gateway/translation/),
then run as a chat completion through the Gateway (placement, retries, token limits) under its key's quotas,
plain, streamed or in the background; stored, when asked, before the answer leaves (an immediate follow-up
with ``previous_response_id`` finds it)."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import AsyncIterator, NamedTuple

import msgspec

from engines.seam import EngineError
from gateway.config import ResponsesConfig
from gateway.domain_errors import DomainError, Invalid
from gateway.errors import body_error
from gateway.quotas import Quotas
from gateway.responses.contexts import ConversationContexts
from gateway.responses.store import ResponseStore, StoredResponse
from gateway.service import Gateway
from gateway.state import StateStore, StoreUnavailable
from gateway.chat_path import ROUTE, check_chat, chunks
from gateway.translation.chat import completion_decoder
from gateway.translation.response_stream import ResponseStream
from gateway.translation.responses import (
    CHAT_PARAMS,
    chat_messages,
    function_tools,
    incomplete,
    input_items,
    output_items,
    resolve_references,
    to_chat,
    tool_choice,
    usage,
)
from wire.errors import InvalidRequest
from wire.openai import served_tier
from wire.responses import Item, Response, ResponseError, ResponsesRequest, TextConfig

log = logging.getLogger("parrot.responses")
_KNOWN = frozenset(ResponsesRequest.__struct_fields__) | {"parrot", "conversation", "prompt", "stream_options"}


class Prepared(NamedTuple):
    """A checked request: the chat body that runs it and the response it becomes."""

    owner: str
    request: ResponsesRequest
    input: list[Item]
    earlier: list[Item]
    chat: dict
    estimate: int  # tokens charged to the key when the engine reports no usage
    response: Response


class ResponsesService:
    def __init__(self, gateway: Gateway, quotas: Quotas, config: ResponsesConfig, state: StateStore | None = None):
        """``state``: where stored responses are written through to (gateway/responses/store.py)."""
        self.gateway = gateway
        self.quotas = quotas
        self.config = config
        self.store = ResponseStore(config, state=state)
        self.contexts = ConversationContexts(gateway, config)  # stored conversations pinned on the engine
        self.store.on_drop = self.contexts.release

    def sweep(self) -> None:
        """Forgets the stored responses past their TTL and frees the pinned conversations idle too long."""
        self.store.sweep()
        self.contexts.sweep()

    # ------------------------------------------------------------ checking

    async def prepare(self, raw: bytes, owner: str) -> Prepared:
        try:
            body = msgspec.json.decode(raw)
            request = msgspec.convert(body, ResponsesRequest)
        except (msgspec.DecodeError, UnicodeDecodeError) as exc:
            raise body_error(exc, raw) from None
        if request.background and request.store is False:
            raise Invalid("background responses must be stored: store must not be false", param="background")
        tools = function_tools(request)
        choice = tool_choice(request, tools)
        items = input_items(request, self.config.max_input_items)
        earlier: list[Item] = []
        if request.previous_response_id:
            earlier = await self._conversation(owner, request.previous_response_id)
        items = resolve_references(items, earlier)
        if request.store is not False:
            self.store.check_size(earlier, items)  # a 413 before the engine works, not after
        chat = to_chat(request, [*earlier, *items], tools, choice)
        # Fields this API does not know go to the engine, as on the chat path (vLLM's sampling extras).
        chat.update((name, value) for name, value in body.items() if name not in _KNOWN and name not in chat)
        checked = check_chat(self.gateway, chat, CHAT_PARAMS, "input")
        response = Response(
            model=request.model, instructions=request.instructions, tools=tools, tool_choice=choice,
            parallel_tool_calls=request.parallel_tool_calls is not False, text=request.text or TextConfig(),
            max_output_tokens=request.max_output_tokens, temperature=request.temperature, top_p=request.top_p,
            previous_response_id=request.previous_response_id, store=request.store is not False,
            background=bool(request.background), metadata=request.metadata or {}, user=request.user,
            service_tier=served_tier(request.service_tier))
        return Prepared(owner, request, items, earlier, chat, self.gateway.max_request_tokens(checked) or 0, response)

    async def _conversation(self, owner: str, response_id: str) -> list[Item]:
        try:
            stored = await self.store.fetch(owner, response_id)
        except DomainError as exc:
            exc.param = "previous_response_id"
            raise
        if stored.task is not None and not stored.task.done():  # a background turn still running: its end
            await asyncio.wait([stored.task])
        if stored.response.status in ("failed", "cancelled"):
            raise Invalid(f"previous response {response_id!r} is {stored.response.status}: nothing to continue",
                          param="previous_response_id")
        return stored.conversation()

    # ------------------------------------------------------------ running

    async def _store(self, prepared: Prepared) -> StoredResponse | None:
        if not prepared.response.store:
            return None
        stored = StoredResponse(prepared.response, prepared.input, prepared.earlier)
        await self.store.saved(prepared.owner, stored)
        return stored

    def _finish(self, response: Response, body: bytes) -> None:
        completion = completion_decoder.decode(body)
        response.output = output_items(completion)
        response.usage = usage(completion.usage)
        response.incomplete_details = incomplete(completion.choices[0].finish_reason if completion.choices else None)
        response.status = "incomplete" if response.incomplete_details is not None else "completed"
        if completion.service_tier:  # the tier the engine says it served it on
            response.service_tier = completion.service_tier

    async def create(self, prepared: Prepared) -> Response:
        """A response run to its end and stored (when asked) before it is returned. A next turn of a
        conversation pinned on an engine runs as a fork of it there (contexts.py); its own conversation is
        pinned in turn."""
        async with self.quotas.admitted(prepared.owner, prepared.estimate):
            forked = None
            if prepared.request.previous_response_id:
                forked = await self.contexts.fork(prepared.request.previous_response_id, prepared.chat)
            if forked is None:
                answer = await self.gateway.create(ROUTE, prepared.request.model, prepared.chat)
                forked = (answer.body, answer.engine_id)
        body, engine_id = forked
        self._finish(prepared.response, body)
        if await self._store(prepared) is not None:
            self._pin(prepared, engine_id)
            if prepared.request.previous_response_id:  # the conversation goes on from this turn's context now:
                self.contexts.release(prepared.request.previous_response_id)  # a branch from the last runs plain
        return prepared.response

    def _pin(self, prepared: Prepared, engine_id: str) -> None:
        if prepared.response.status == "completed":
            self.contexts.pin_later(prepared.response.id, engine_id, prepared.chat,
                                    chat_messages(None, prepared.response.output))

    async def start_background(self, prepared: Prepared) -> bytes:
        """A response queued and run by a task of its own; answered (as it stands now) at once."""
        prepared.response.status = "queued"
        admission = await self.quotas.admitted_later(prepared.owner, prepared.estimate)  # a 429 now, not later
        try:
            stored = await self._store(prepared)
        except BaseException:
            if admission is not None:
                await admission.release()
            raise
        assert stored is not None  # background implies store
        stored.task = asyncio.create_task(self._background(prepared, stored, admission))

        def settled(_: asyncio.Task) -> None:  # also when cancelled before it ever ran
            if admission is not None:
                admission.release_soon()  # once, whoever comes first
            if prepared.response.status in ("queued", "in_progress"):
                prepared.response.status = "cancelled"

        stored.task.add_done_callback(settled)
        return msgspec.json.encode(prepared.response)

    async def _background(self, prepared: Prepared, stored: StoredResponse, admission) -> None:
        response = prepared.response
        response.status = "in_progress"
        try:
            async with self.quotas.holding(admission):
                answer = await self.gateway.create(ROUTE, prepared.request.model, prepared.chat)
            self._finish(response, answer.body)
        except asyncio.CancelledError:
            response.status = "cancelled"
        except (EngineError, DomainError, InvalidRequest) as exc:
            response.status = "failed"
            response.error = ResponseError(code=getattr(exc, "code", None) or "server_error", message=str(exc))
        except Exception as exc:  # the task's end must be recorded whatever happened
            log.exception("background response %s failed", response.id)
            response.status = "failed"
            response.error = ResponseError(code="server_error", message=f"internal error: {type(exc).__name__}")
        try:
            await self.store.saved(prepared.owner, stored)  # measured again, now with its output
        except DomainError as exc:
            response.status, response.output = "failed", []
            response.error = ResponseError(code=exc.code or "response_too_large", message=exc.message)
            await self._saved_quietly(prepared.owner, stored)
        except StoreUnavailable:
            log.warning("background response %s: its end was not written to the state store", response.id)

    async def _saved_quietly(self, owner: str, stored: StoredResponse) -> None:
        with contextlib.suppress(DomainError, StoreUnavailable):
            await self.store.saved(owner, stored)

    async def cancel(self, owner: str, response_id: str) -> Response:
        stored = await self.store.fetch(owner, response_id)
        if not stored.response.background:
            raise Invalid("Only background responses can be cancelled.", param="response_id")
        task = stored.task
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        if stored.response.status in ("queued", "in_progress"):  # cancelled before it ever ran
            stored.response.status = "cancelled"
            await self.store.saved(owner, stored)
        return stored.response

    async def delete(self, owner: str, response_id: str) -> None:
        stored = await self.store.removed(owner, response_id)
        if stored.task is not None and not stored.task.done():
            await asyncio.wait([stored.task])

    async def stream(self, prepared: Prepared) -> AsyncIterator[bytes]:
        """The response's SSE events. The first item comes once the engine's stream has started (errors
        before it are the request's HTTP status); the response is stored before its last event."""
        writer = ResponseStream(prepared.response)
        async with self.quotas.admitted(prepared.owner, prepared.estimate):
            opened = await self.gateway.open_stream(ROUTE, prepared.request.model, prepared.chat)
            stored = await self._store(prepared)  # in progress: GET finds it while it streams
            try:
                yield writer.start()
                stream = chunks(self.gateway, prepared.request.model, opened)
                try:
                    async for chunk in stream:
                        if chunk.error is not None:
                            yield writer.fail(chunk.error.code or chunk.error.type, chunk.error.message)
                        else:
                            out = writer.feed(chunk)
                            if out:
                                yield out
                finally:
                    await stream.aclose()  # the engine's stream closed at once when the client leaves
                if prepared.response.status == "in_progress":
                    yield writer.finish()
                if stored is not None:
                    await self.store.saved(prepared.owner, stored)
                    self._pin(prepared, opened.record.id)
                yield writer.last()
            finally:
                if prepared.response.status == "in_progress":  # the client left before the end
                    writer.fail("client_disconnected", "the client closed the stream before the response ended")
