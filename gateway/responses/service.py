"""Responses run over the chat-completions path: a request checked and translated (gateway/translation/),
then run as a chat completion through the Gateway (placement, retries, token limits) under its key's quotas,
plain, streamed or in the background; stored, when asked, before the answer leaves (an immediate follow-up
with ``previous_response_id`` finds it). A model whose engines speak the Responses API themselves gets its
requests passed through to them (passthrough.py) instead. With the ``parrot`` extension the translated chat body
is a semantic request of the chat path (gateway/semantic/), whose chat answer is translated back as an engine's is."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any, AsyncIterator, NamedTuple

import msgspec
from litestar import Response as HTTPResponse

from engines.seam import EngineError
from gateway.config import ResponsesConfig
from gateway.domain_errors import DomainError, Invalid
from gateway.errors import body_error
from gateway.quotas import Admission, Quotas
from gateway.responses.background import BackgroundRuns, RunRecord
from gateway.responses.contexts import ConversationContexts
from gateway.responses.passthrough import UpstreamEvents, adopt_body, read_answer, read_event, upstream_body
from gateway.responses.store import ResponseStore, StoredResponse
from gateway.semantic import template
from gateway.semantic.service import SemanticService, Submitted
from gateway.service import ENGINE_HEADER, Gateway
from gateway.state import StateStore, StoreUnavailable
from gateway.chat_path import ROUTE, check_chat, chunks_of, extension_of
from gateway.translation.chat import Chunk, completion_decoder
from gateway.translation.response_stream import ResponseStream
from gateway.translation.responses import (
    CHAT_PARAMS,
    chat_messages,
    function_tools,
    incomplete,
    input_items,
    output_items,
    resolve_references,
    texts_changed,
    to_chat,
    tool_choice,
    usage,
)
from wire.errors import InvalidRequest
from wire.openai import served_tier
from wire.sse import SSE_DONE
from wire.placeholders import map_texts
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
    parrot: dict[str, Any] | None = None  # the semantic-variable extension: run on the semantic path
    upstream: dict[str, Any] | None = None  # the body passed through to an engine that speaks Responses


class Ran(NamedTuple):
    """A response's chat completion: where it ran, and the request as it is stored (a semantic one's
    placeholders filled with the values its prompt held)."""

    body: bytes
    engine_id: str
    prepared: Prepared


class ResponsesService:
    def __init__(self, gateway: Gateway, quotas: Quotas, config: ResponsesConfig, semantic: SemanticService,
                 state: StateStore | None = None, lease_s: float = 10.0):
        """``state``: where stored responses are written through to (gateway/responses/store.py); ``lease_s``:
        a background response's lease there (background.py)."""
        self.gateway = gateway
        self.quotas = quotas
        self.config = config
        self.semantic = semantic
        self.store = ResponseStore(config, state=state)
        self.background = BackgroundRuns(self.store, lease_s=lease_s)  # background responses that survive a replica
        self.background.resume = self._resume
        self.contexts = ConversationContexts(gateway, config)  # stored conversations pinned on the engine
        self.store.on_drop = self.contexts.release

    def start(self) -> None:
        """Runs the background responses a previous process (then, on a shared store, a replica that died) left."""
        self.background.start()

    async def aclose(self) -> None:
        await self.background.aclose()

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
        parrot = semantic_extension(body, request)
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
        # A semantic request's usage is charged by its call, which may outlive this response (as on the chat path).
        estimate = 0 if parrot is not None else self.gateway.max_request_tokens(checked) or 0
        # Passed through where the model's engines speak Responses; a semantic request runs as a chat request.
        upstream = upstream_body(body, items, earlier) if parrot is None and self.gateway.serves_responses(
            request.model) else None
        return Prepared(owner, request, items, earlier, chat, estimate, response, parrot, upstream)

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

    def _finish(self, prepared: Prepared, body: bytes) -> None:
        """The engine's answer (a chat completion, or a passed-through Response) into the response."""
        response = prepared.response
        if prepared.upstream is not None:
            adopt_body(response, body)
            return
        completion = completion_decoder.decode(body)
        response.output = output_items(completion)
        response.usage = usage(completion.usage)
        response.incomplete_details = incomplete(completion.choices[0].finish_reason if completion.choices else None)
        response.status = "incomplete" if response.incomplete_details is not None else "completed"
        if completion.service_tier:  # the tier the engine says it served it on
            response.service_tier = completion.service_tier

    async def create(self, prepared: Prepared) -> Response | HTTPResponse:
        """A response run to its end and stored (when asked) before it is returned. A next turn of a
        conversation pinned on an engine runs as a fork of it there (contexts.py); its own conversation is
        pinned in turn. A semantic request with ``parrot.wait`` false is answered 202 at once, as on the chat path."""
        async with self.quotas.admitted(prepared.owner, prepared.estimate):
            if prepared.parrot is not None:
                ran = await self._semantic(prepared)
                if isinstance(ran, HTTPResponse):
                    return ran
            elif prepared.upstream is not None:
                ran = await self._through(prepared)
            else:
                ran = await self._plain(prepared)
        body, engine_id, prepared = ran
        self._finish(prepared, body)
        if await self._store(prepared) is not None:
            self._pin(prepared, engine_id)
            if prepared.request.previous_response_id:  # the conversation goes on from this turn's context now:
                self.contexts.release(prepared.request.previous_response_id)  # a branch from the last runs plain
        return prepared.response

    async def _through(self, prepared: Prepared) -> Ran:
        assert prepared.upstream is not None
        answer = await self.gateway.create("responses", prepared.request.model, prepared.upstream, read=read_answer)
        return Ran(answer.body, answer.engine_id, prepared)

    async def _plain(self, prepared: Prepared) -> Ran:
        forked = None
        if prepared.request.previous_response_id:
            forked = await self.contexts.fork(prepared.request.previous_response_id, prepared.chat,
                                              _kept_for(prepared))
        if forked is None:
            answer = await self.gateway.create(ROUTE, prepared.request.model, prepared.chat)
            forked = (answer.body, answer.engine_id)
        return Ran(*forked, prepared)

    async def _semantic(self, prepared: Prepared) -> Ran | HTTPResponse:
        """The request's chat body run whole on the semantic path; its 202 when it does not wait."""
        submitted = await self._submit(prepared, stream=False)
        answered = await self.semantic.answer(submitted)
        if not submitted.wait:
            return answered
        return Ran(answered.content, answered.headers[ENGINE_HEADER], await _with_values(prepared, submitted))

    async def _submit(self, prepared: Prepared, *, stream: bool) -> Submitted:
        assert prepared.parrot is not None
        submitted = await self.semantic.submit(ROUTE, prepared.parrot, prepared.chat, prepared.owner, stream)
        prepared.response.parrot = msgspec.to_builtins(submitted.result)
        return submitted

    def _pin(self, prepared: Prepared, engine_id: str) -> None:
        """A stored turn's conversation pinned for its next turn; one cut short by ``max_output_tokens`` too (the
        conversation goes on from what it answered), not a failed one (whose fork's context is freed)."""
        if prepared.response.status in ("completed", "incomplete"):
            self.contexts.pin_later(prepared.response.id, engine_id, prepared.chat,
                                    chat_messages(None, prepared.response.output))
        else:
            self.contexts.release(prepared.response.id)

    async def start_background(self, prepared: Prepared) -> bytes:
        """A response queued and run by a task of its own; answered (as it stands now) at once. It is recorded
        with what it runs (background.py): if this replica dies, another runs it again."""
        prepared.response.status = "queued"
        admission = await self.quotas.admitted_later(prepared.owner, prepared.estimate)  # a 429 now, not later
        stored = StoredResponse(prepared.response, prepared.input, prepared.earlier)
        try:
            await self.background.started(prepared.owner, stored, RunRecord(
                prepared.request, prepared.chat, prepared.estimate, prepared.parrot, prepared.upstream))
        except BaseException:
            if admission is not None:
                await admission.release()
            raise
        self._run_background(prepared, stored, admission)
        return msgspec.json.encode(prepared.response)

    def _resume(self, owner: str, stored: StoredResponse, run: RunRecord) -> None:
        """A background response another replica (or a previous process) left unfinished, run again here; its key's
        quotas admitted it when it was created."""
        self._run_background(Prepared(owner, run.request, stored.input, stored.earlier, run.chat, run.estimate,
                                      stored.response, run.parrot, run.upstream), stored, None)

    def _run_background(self, prepared: Prepared, stored: StoredResponse, admission: Admission | None) -> None:
        stored.task = asyncio.create_task(self._background(prepared, stored, admission))
        self.background.running_here(prepared.response.id, stored.task)
        if admission is not None:  # released once, whoever comes first (also when cancelled before it ever ran)
            stored.task.add_done_callback(lambda _: admission.release_soon())

    async def _background(self, prepared: Prepared, stored: StoredResponse, admission: Admission | None) -> None:
        response = prepared.response
        response.status = "in_progress"
        try:
            with contextlib.suppress(StoreUnavailable):
                await self.store.saved(prepared.owner, stored)  # in progress, as other replicas see it too
            async with self.quotas.holding(admission):
                if prepared.parrot is not None:
                    ran = await self._semantic(prepared)  # waits: a background request with wait false is a 400
                    assert not isinstance(ran, HTTPResponse)
                    stored.input = ran.prepared.input
                    body = ran.body
                elif prepared.upstream is not None:
                    body = (await self._through(prepared)).body
                else:
                    body = (await self.gateway.create(ROUTE, prepared.request.model, prepared.chat)).body
            self._finish(prepared, body)
        except asyncio.CancelledError:
            if self.background.closing:
                raise  # the gateway stops: run again by another replica, or by this gateway started again
            response.status = "cancelled"
        except (EngineError, DomainError, InvalidRequest) as exc:
            response.status = "failed"
            response.error = ResponseError(code=getattr(exc, "code", None) or "server_error", message=str(exc))
        except Exception as exc:  # the task's end must be recorded whatever happened
            log.exception("background response %s failed", response.id)
            response.status = "failed"
            response.error = ResponseError(code="server_error", message=f"internal error: {type(exc).__name__}")
        try:
            await self.background.ended(prepared.owner, stored)
        except DomainError as exc:
            response.status, response.output = "failed", []
            response.error = ResponseError(code=exc.code or "response_too_large", message=exc.message)
            with contextlib.suppress(DomainError, StoreUnavailable):
                await self.background.ended(prepared.owner, stored)
        except StoreUnavailable:
            log.warning("background response %s: its end was not written to the state store", response.id)

    async def cancel(self, owner: str, response_id: str) -> Response:
        stored = await self.store.fetch(owner, response_id)
        if not stored.response.background:
            raise Invalid("Only background responses can be cancelled.", param="response_id")
        task = stored.task
        if task is not None and not task.done():
            task.cancel()  # its end, cancelled, is published by the task
            await asyncio.wait([task])
        elif stored.response.status in ("queued", "in_progress"):  # run by another replica (or nobody, yet)
            await self.background.stop_elsewhere(response_id)
        if stored.response.status in ("queued", "in_progress"):  # cancelled before it ever ran here
            stored.response.status = "cancelled"
            await self.background.ended(owner, stored)  # the end published first is the one answered
        return stored.response

    async def delete(self, owner: str, response_id: str) -> None:
        stored = await self.store.removed(owner, response_id)
        if stored.task is not None and not stored.task.done():
            await asyncio.wait([stored.task])
        elif stored.response.background and stored.response.status in ("queued", "in_progress"):
            await self.background.stop_elsewhere(response_id)

    async def stream(self, prepared: Prepared) -> AsyncIterator[bytes]:
        """The response's SSE events. The first item comes once the engine's stream has started (errors
        before it are the request's HTTP status); the response is stored before its last event."""
        if prepared.upstream is not None:
            async with contextlib.aclosing(self._stream_through(prepared)) as events:
                async for event in events:
                    yield event
            return
        writer = ResponseStream(prepared.response)
        async with self.quotas.admitted(prepared.owner, prepared.estimate):
            submitted = None
            if prepared.parrot is not None:
                submitted = await self._submit(prepared, stream=True)
                answered = await self.semantic.answer(submitted)  # its first text generated (or its end)
                stream, engine_id = chunks_of(answered.iterator), answered.headers.get(ENGINE_HEADER, "")
            else:
                stream, engine_id = await self._open_stream(prepared)
            stored = await self._store(prepared)  # in progress: GET finds it while it streams
            try:
                yield writer.start()
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
                    if submitted is not None and prepared.response.status != "failed":
                        prepared = await _with_values(prepared, submitted)
                        stored.input = prepared.input
                    await self.store.saved(prepared.owner, stored)
                    self._pin(prepared, engine_id)
                    if prepared.request.previous_response_id:  # as in create: the conversation goes on from here
                        self.contexts.release(prepared.request.previous_response_id)
                yield writer.last()
            finally:
                if prepared.response.status == "in_progress":  # the client left before the end
                    writer.fail("client_disconnected", "the client closed the stream before the response ended")

    async def _open_stream(self, prepared: Prepared) -> tuple[AsyncIterator[Chunk], str]:
        """The chat chunks of a plain streamed response and its engine's id: a next turn of a conversation
        pinned on an engine streams as a fork of it there (contexts.py), else as a chat stream."""
        if prepared.request.previous_response_id:
            forked = await self.contexts.fork_stream(prepared.request.previous_response_id, prepared.chat,
                                                     _kept_for(prepared))
            if forked is not None:
                return forked
        opened = await self.gateway.open_stream(ROUTE, prepared.request.model, prepared.chat)
        return chunks_of(self.gateway.sse_events(prepared.request.model, opened)), opened.record.id

    async def _stream_through(self, prepared: Prepared) -> AsyncIterator[bytes]:
        """The engine's own Responses stream, passed through (passthrough.UpstreamEvents); the response is
        stored before the event that ends it goes out."""
        assert prepared.upstream is not None
        relay = UpstreamEvents(prepared.response)
        model = prepared.request.model
        async with self.quotas.admitted(prepared.owner, prepared.estimate):
            opened = await self.gateway.open_stream("responses", model, prepared.upstream)
            stored = await self._store(prepared)  # in progress: GET finds it while it streams
            events = self.gateway.sse_events(model, opened, read=read_event)
            try:
                async for data in events:
                    ended = [relay.close()] if data.endswith(SSE_DONE) else []  # the engine's stream is over
                    for event in filter(None, [*relay.feed(data), *ended]):
                        if relay.ended and stored is not None:
                            await self.store.saved(prepared.owner, stored)  # measured again, now with its output
                            stored = None
                        yield event
            finally:
                await events.aclose()
                if prepared.response.status in ("queued", "in_progress"):  # the client left before the end
                    prepared.response.status = "failed"
                    prepared.response.error = ResponseError(
                        code="client_disconnected", message="the client closed the stream before the response ended")


def _kept_for(prepared: Prepared) -> str | None:
    """The response a forked turn keeps its context for (its next turn's pin): a stored one's."""
    return prepared.response.id if prepared.response.store else None


def semantic_extension(body: dict[str, Any], request: ResponsesRequest) -> dict[str, Any] | None:
    """The request's ``parrot`` object (None: a plain request), as far as it can be checked before it runs."""
    parrot = extension_of(body)
    if parrot is not None and request.background and parrot.get("wait") is False:
        raise Invalid("a background response waits for its call: leave out parrot.wait, or poll its output "
                      "variable instead of a background response", param="parrot.wait")
    return parrot


async def _with_values(prepared: Prepared, submitted: Submitted) -> Prepared:
    """A semantic request as it ran: its placeholders replaced by the values its prompt held, so that the stored
    conversation, and a next turn over it, read what the model read."""
    values = await submitted.input_values()
    if not values:
        return prepared
    change = lambda text: template.substitute(text, values)  # noqa: E731
    return prepared._replace(input=texts_changed(prepared.input, change), chat=map_texts(ROUTE, prepared.chat, change))

