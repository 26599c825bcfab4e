"""Semantic variables end to end: bind a request's placeholders, link it into its session's graph,
run it when its inputs are ready, and answer now (202) or when its output is bound."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from typing import Any, AsyncIterator, Callable, NamedTuple

import msgspec
from litestar import Response

from engines.seam import EngineError, Route
from wire.sse import SSE_DONE, sse_event
from wire.openai import CompletionRequest
from wire.errors import InvalidRequest
from gateway.config import QuotaLimits, SemanticConfig, TracingConfig
from gateway.errors import invalid_field
from gateway.domain_errors import Conflict, DependencyFailed, DomainError, NotFound, model_not_found
from gateway.semantic import template
from gateway.semantic.answer import Reply
from gateway.semantic.call_spec import CallSpec, Step
from gateway.semantic.durable_calls import CallRecord, DurableCalls
from gateway.semantic.graph import Call, Session, Variable, VariableFailed
from gateway.semantic.persisted import Mirror
from gateway.semantic.sessions import SessionStore
from gateway.state import StateStore, StoreUnavailable
from gateway.semantic.prefix import PrefixCache
from gateway.semantic.runner import Runner
from gateway.semantic.streaming import StreamedAnswer, TextSink
from wire.placeholders import texts
from gateway.semantic.schema import (
    Accepted,
    InlineExtension,
    OutputRef,
    OutputSpec,
    OutputView,
    ParrotExtension,
    ParrotResult,
    SemanticCall,
    VarRef,
    VarView,
)
from gateway.service import ENGINE_HEADER, REQUEST_SCHEMAS, Gateway, with_service_tier
from wire.sampling import tier_criteria
from gateway.streaming import EventStream
from gateway.tracing import Tracing

log = logging.getLogger("parrot.semantic")
JSON = "application/json"
# How long deleting a session waits for its cancelled calls to unwind (they do at their next await).
_UNWIND_WAIT_S = 10.0
# How long reading a finished call's inputs may wait: each was bound before its call ran, but for one a producer
# handed over on the engine (handoff.py), bound when that producer's answer comes back to the gateway.
_BOUND_WAIT_S = 30.0


def view(variable: Variable) -> VarView:
    return VarView(id=variable.id, name=variable.name, session_id=variable.session.id, ready=variable.ready,
                   value=variable.value, error=variable.error, producer=variable.producer_id)


class Submitted(NamedTuple):
    """An extension request whose call is linked and started (``SemanticService.submit``)."""

    route: Route
    body: dict[str, Any]  # as its call runs it (no stream fields)
    call: Call
    reply: Reply
    result: ParrotResult
    made: set[str]  # the variables it made (forgotten again if the engine refuses it)
    wait: bool
    stream: bool
    include_usage: bool

    async def input_values(self) -> dict[str, str]:
        """What each of its placeholders was bound to, once its call has run: the text its prompt holds."""
        return {name: await variable.get(_BOUND_WAIT_S) for name, variable in self.call.inputs.items()}


class SemanticService:
    def __init__(self, gateway: Gateway, config: SemanticConfig,
                 limits_of: Callable[[str], QuotaLimits] | None = None, tracing: Tracing | None = None,
                 store: StateStore | None = None, lease_s: float = 10.0):
        """``limits_of(owner)``: the quotas of an API key's sessions; ``tracing``: spans for calls; ``store``:
        where sessions, variables and calls are written through to, when it keeps them (SQLite, Redis);
        ``lease_s``: a call's lease there (durable_calls.py)."""
        self.gateway = gateway
        self.config = config
        self.tracing = tracing or Tracing(TracingConfig(enabled=False))
        self.sessions = SessionStore(config.default_session_max_variables, limits_of=limits_of,
                                     finished_calls_kept=config.finished_calls_kept)
        self.prefixes = PrefixCache(config.max_prefixes_per_engine)
        gateway.registry.on_removed(self.prefixes.forget_engine)  # its contexts went with it
        self.runner = Runner(gateway, self.prefixes, config, self.tracing, gateway.config.scheduler.kv_full,
                             gateway.config.kv_events.rewarm)
        self.mirror = Mirror(store, config.session_idle_ttl_s) if store is not None and (
            store.shared or store.durable) else None
        if self.mirror is not None:
            self.sessions.use(self.mirror)
            calls = self.mirror.calls = DurableCalls(store, self.mirror.writer, lease_s=lease_s,
                                                     ttl_s=self.mirror.ttl_s)
            calls.resume, calls.serves = self._resume, gateway.registry.serves
        self._watch: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Subscribes to the store's wake-ups (and, on a shared store, watches for producers lost with a replica)."""
        if self.mirror is not None:
            self.mirror.start()
            self.mirror.calls.start()
            if self.mirror.shared:
                self._watch = asyncio.get_running_loop().create_task(self._watch_producers(), name="producers")

    async def aclose(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            await asyncio.gather(self._watch, return_exceptions=True)
        if self.mirror is not None:
            await self.mirror.aclose()

    async def _watch_producers(self) -> None:
        while True:
            await asyncio.sleep(5.0)
            try:
                await self.sessions.check_producers()
            except StoreUnavailable:
                pass
            except Exception:
                log.exception("checking remote producers failed")

    async def _resume(self, call_id: str, record: CallRecord, published: dict[str, str] | None) -> bool:
        """A call taken over from a replica that died (or a process before a restart): linked into its session
        here and run again, or, when its outputs were published already, those bound. False: its session or
        its variables are gone."""
        await self.sessions.fetch(record.session)
        session = self.sessions.held(record.session)
        if session is None or session.closed:
            return False
        inputs = {name: session.variables.get(var_id) for name, var_id in record.inputs.items()}
        outputs = {name: session.variables.get(var_id) for name, var_id in record.outputs.items()}
        if None in inputs.values() or None in outputs.values() or any(v.producer for v in outputs.values()):
            return False
        if published is not None or any(v.ready for v in outputs.values()):
            for name, variable in outputs.items():
                if not variable.ready and published is not None and name in published:
                    variable.set(published[name])
            return False
        spec = CallSpec(tuple(Step(s.route, s.body, s.output) for s in record.steps), warm=record.warm)
        call = Call(session, inputs, outputs, spec, self.runner, latency=record.latency, call_id=call_id)
        self._start(session, call)
        await self.sessions.flushed()
        return True

    # ------------------------------------------------------------ binding

    def _bind(self, session: Session, placeholders: set[str], refs: dict[str, VarRef], param: str,
              inline: InlineCalls | None = None) -> dict[str, Variable]:
        """Each placeholder's variable; ``inline`` makes those bound to an inline call (the extension's)."""
        unbound = sorted(placeholders - refs.keys())
        if unbound:
            raise InvalidRequest(f"placeholders without a binding in {param}: "
                                 + ", ".join("{{" + n + "}}" for n in unbound), param)
        inputs = {}
        for name in sorted(placeholders):
            ref, where = refs[name], f"{param}.{name}"
            kinds = "'id', 'value' and 'call'" if inline else "'id' and 'value'"
            if sum(x is not None for x in (ref.id, ref.value, ref.call)) != 1 or (ref.call is not None and not inline):
                raise InvalidRequest(f"{where} needs exactly one of {kinds}", where)
            if ref.call is not None:
                inputs[name] = inline.make(name, ref.call, f"{where}.call")
            else:
                inputs[name] = session.variable(ref.id) if ref.id else session.new_variable(name, ref.value)
        return inputs

    @staticmethod
    def _output(session: Session, output: str | OutputRef | None) -> Variable:
        if isinstance(output, OutputRef) and output.id is not None:
            if output.name is not None:
                raise InvalidRequest("parrot.output takes one of 'name' (a new variable) and 'id' (an existing "
                                     "one), not both", "parrot.output")
            return session.variable(output.id)
        name = output if isinstance(output, str) else (output.name if output else None)
        return session.new_variable(name or "output")

    def _start(self, session: Session, call: Call) -> None:
        session.add_call(call, self.config.input_timeout_s)

    # ------------------------------------------------------------ OpenAI extension

    async def serve(self, route: Route, raw_extension: dict[str, Any], body: dict[str, Any], owner: str,
                    stream: bool) -> Response:
        """An extension request answered as its endpoint answers: 202 (``wait: false``), a stream or JSON."""
        return await self.answer(await self.submit(route, raw_extension, body, owner, stream))

    async def submit(self, route: Route, raw_extension: dict[str, Any], body: dict[str, Any], owner: str,
                     stream: bool) -> Submitted:
        """The request's placeholders bound and its call linked into its session and started. Other APIs
        (Responses, Messages) submit their translated chat body here and translate ``answer``'s answer back."""
        try:
            ext = msgspec.convert(raw_extension, ParrotExtension)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"invalid parrot extension: {exc}", "parrot") from None
        if stream and not ext.wait:
            raise InvalidRequest("stream cannot be combined with parrot.wait=false: the answer is the queued "
                                 "call's variable id; read its value with GET /v1/vars/{id}", "parrot.wait")
        await self.sessions.prepare(ext.session_id, owner, _named_ids(raw_extension))
        session = self.sessions.resolve(ext.session_id, owner)
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        body = {k: v for k, v in body.items() if k not in ("stream", "stream_options")}  # runs whole, server-side
        reply = Reply(TextSink() if stream else None)
        criteria = ext.criteria or tier_criteria(body)  # the extension's, else the one service_tier names
        latency = criteria == "latency" or (criteria is None and ext.wait)
        inline = InlineCalls(self, route, session)
        with session.undo_on_error() as made:
            inputs = self._bind(session, _placeholders(route, body), ext.vars, "parrot.vars", inline)
            output = self._output(session, ext.output)
            call = self._extension_call(route, body, session, inputs, output, latency, reply)
        result = ParrotResult(session_id=session.id, output=OutputView(id=output.id, name=output.name),
                              call_id=call.id, inline={path: OutputView(id=v.id, name=v.name)
                                                       for path, v in inline.outputs.items()})
        return Submitted(route, body, call, reply, result, made, ext.wait, stream, include_usage)

    async def answer(self, submitted: Submitted) -> Response:
        """A submitted request's answer: 202 with its variables (``wait: false``), else once its call
        generates, streamed as it does (``stream``) or whole; the chat or completions body with ``parrot``."""
        route, body, call, reply, result = (submitted.route, submitted.body, submitted.call, submitted.reply,
                                            submitted.result)
        if not submitted.wait:
            result.status = "queued"
            await self.sessions.flushed()  # what it made is in the store before it is acknowledged
            return Response(msgspec.json.encode(Accepted(parrot=result)), status_code=202, media_type=JSON)
        if reply.sink is not None:
            assert call.task is not None
            reply.sink.follow(call.task)
            first = await reply.sink.first()
            if first is not None:
                return self._stream(call, reply, first,
                                    StreamedAnswer(route, body["model"], result, submitted.include_usage))
        await self._finish_request(call, submitted.made)
        await self.sessions.flushed()
        answer = reply.answer
        assert answer is not None  # its call ran
        where = {ENGINE_HEADER: answer.engine_id}
        if submitted.stream:  # ended without text: its one chunk
            return _as_stream(route, answer.as_dict() | {"parrot": result}, submitted.include_usage, where)
        return Response(with_service_tier(answer.encoded(msgspec.json.encode(result)), body), media_type=JSON,
                        headers=where)

    def _extension_call(self, route: Route, body: dict[str, Any], session: Session, inputs: dict[str, Variable],
                        output: Variable, latency: bool, reply: Reply | None) -> Call:
        """The call of an extension request (or of an inline one) linked into its session and started; its
        answer goes to ``reply`` (None: an inline call's, which only its output variable gets)."""
        call = Call(session, inputs, {"output": output}, CallSpec.of_request(route, body, reply), self.runner,
                    latency=latency)
        self._start(session, call)
        return call

    async def _finish_request(self, call: Call, made: set[str]) -> None:
        """``_finish``; a request the engine refused leaves nothing behind in its session, as a 400 here."""
        try:
            await self._finish(call)
        except EngineError as exc:
            if exc.status_code < 500:
                call.session.forget(made)
            raise

    def _stream(self, call: Call, reply: Reply, first: str, streamed: StreamedAnswer) -> Response:
        sink = reply.sink
        assert sink is not None

        async def events() -> AsyncIterator[bytes]:
            yield streamed.opening(first)
            try:
                async for piece in sink.rest():
                    yield streamed.piece(piece)
            except asyncio.CancelledError:
                if call.task is not None and not call.task.done():  # cut, not the call: it goes on, and says so
                    with contextlib.suppress(BaseException):
                        yield streamed.cut(call.id)
                raise
            try:
                await self._finish(call)
                await self.sessions.flushed()
            except Exception as exc:  # headers are gone: in-band, as a failing engine stream reports it
                yield streamed.failed(exc)
                return
            assert reply.answer is not None  # its call ran
            yield streamed.closing(reply.answer)

        where = {ENGINE_HEADER: sink.engine_id} if sink.engine_id else {}
        return EventStream(events(), media_type="text/event-stream", headers={"cache-control": "no-cache", **where})

    @staticmethod
    async def _finish(call: Call) -> None:
        """Wait for the call (it runs on even if this client goes away); failures become HTTP errors."""
        assert call.task is not None
        try:
            await asyncio.shield(call.task)
        except VariableFailed as exc:
            raise DependencyFailed(f"call {call.id} could not run: {exc}", code="dependency_failed") from None
        except asyncio.CancelledError:
            if not call.task.cancelled() or asyncio.current_task().cancelling():
                raise  # this request itself is being cancelled
            raise Conflict(f"call {call.id} was cancelled: its session {call.session.id} was deleted",
                           code="session_deleted") from None

    # ------------------------------------------------------------ native API

    async def close_session(self, session_id: str, owner: str) -> tuple[int, int]:
        session, variables = self.sessions.remove(session_id, owner)  # cancels its calls
        running = [task for task in session.cancelled_tasks if not task.done()]
        try:
            if running:  # as they unwind they let go of their shared prefixes, which can then be freed here
                await asyncio.wait(running, timeout=_UNWIND_WAIT_S)
        finally:
            contexts = await self.prefixes.drop_session(session.id, session.prefix_keys)
        return variables, contexts

    async def close_idle_sessions(self) -> int:
        """Closes, as DELETE does, every session idle for the configured TTL; returns how many."""
        ttl_s = self.config.session_idle_ttl_s
        closed = 0
        for session in self.sessions.idle(ttl_s):
            # Still idle and not deleted: closing an earlier one awaited, and requests ran meanwhile.
            if self.mirror is not None and self.mirror.shared and self.sessions.is_idle(session, ttl_s):
                self.sessions.evict(session)  # other replicas may use it: the store's TTL ends it
                await self.prefixes.drop_session(session.id, session.prefix_keys)
                closed += 1
            elif self.sessions.is_idle(session, ttl_s):
                with contextlib.suppress(DomainError):
                    await self.close_session(session.id, session.owner)
                    closed += 1
        return closed

    async def read(self, variable: Variable, *, wait: bool, timeout_s: float | None, criteria: str | None
                   ) -> VarView:
        if criteria == "latency" and variable.producer is not None:
            variable.producer.mark_latency()
        if wait:
            try:
                await variable.get(self._wait_s(timeout_s))
            except VariableFailed:
                pass  # the view carries the error
        if variable.session.closed:  # deleted while we waited
            raise NotFound(f"variable {variable.id!r} not found: its session was deleted", code="variable_not_found")
        return view(variable)

    def _wait_s(self, timeout_s: float | None) -> float:
        """A reader's wait: the one asked for (``var_timeout_s`` if none), at most ``max_var_wait_s``, so
        that no reader holds a connection and its task forever (``timeout=inf``)."""
        if timeout_s is not None and math.isnan(timeout_s):
            raise InvalidRequest("timeout must be a number of seconds", "timeout")
        return min(self.config.var_timeout_s if timeout_s is None else timeout_s, self.config.max_var_wait_s)

    def submit_call(self, spec: SemanticCall, owner: str) -> tuple[Session, Call]:
        if not self.gateway.registry.serves(spec.model):
            raise model_not_found(spec.model)
        pieces = template.split(spec.template)
        outputs_in_template = [p.name for p in pieces if p.kind == "output"]
        if not outputs_in_template:
            raise InvalidRequest("template has no {{output:NAME}} placeholder", "template")
        if len(set(outputs_in_template)) != len(outputs_in_template):
            raise InvalidRequest("each {{output:NAME}} may appear once", "template")
        if set(outputs_in_template) & {p.name for p in pieces if p.kind == "input"}:
            raise InvalidRequest("a name cannot be both an input and an output", "template")
        unknown = sorted(spec.outputs.keys() - set(outputs_in_template))
        if unknown:
            raise InvalidRequest(f"outputs.{unknown[0]}: the template has no {{{{output:{unknown[0]}}}}}",
                                 f"outputs.{unknown[0]}")
        for name, output in spec.outputs.items():
            self._check_sampling(spec.model, name, output)
        session = self.sessions.resolve(spec.session_id, owner)
        placeholders = {p.name for p in pieces if p.kind == "input"}
        with session.undo_on_error():
            inputs = self._bind(session, placeholders, spec.inputs, "inputs")
            outputs = {name: session.new_variable(name) for name in outputs_in_template}
            call = Call(session, inputs, outputs, CallSpec.of_template(spec, pieces), self.runner,
                        latency=spec.criteria == "latency")
            self._start(session, call)
        return session, call

    def _check_sampling(self, model: str, name: str, output: OutputSpec) -> None:
        """An output's sampling, held to /v1/completions' ranges and limits before the call is accepted."""
        _checked(self.gateway, CompletionRequest, {"model": model, "prompt": "", **output.sampling()}, f"outputs.{name}")


class InlineCalls:
    """The inline calls of one extension request (``parrot.vars.NAME.call``), each checked as a request of
    its endpoint would be, then linked and started as the request's own call is; their outputs by path
    ("summary_0", nested ones "summary_0.chunk"). At most [semantic] max_inline_calls in all, counted as
    each is declared (before its own inline calls are read), nested at most max_inline_depth deep."""

    def __init__(self, service: SemanticService, route: Route, session: Session, path: str = "",
                 outer: InlineCalls | None = None):
        self.service, self.route, self.session, self.path = service, route, session, path
        self.depth = outer.depth + 1 if outer else 1  # of the calls this level declares
        self.request = outer.request if outer else self  # holds the count and the map for the whole request
        self.outputs: dict[str, Variable] = outer.outputs if outer else {}
        self.declared = 0  # on ``request``: inline calls declared so far, at every depth

    def make(self, name: str, raw: dict[str, Any], param: str) -> Variable:
        """The output variable of the inline call ``raw`` binding placeholder ``name``; its call started."""
        self._declare(param)
        service = self.service
        data = _checked(service.gateway, REQUEST_SCHEMAS[self.route], raw, param)
        if data.stream:
            raise InvalidRequest(f"{param}.stream: an inline call's text goes to its consumer, not to a stream",
                                 f"{param}.stream")
        try:
            ext = msgspec.convert(data.parrot or {}, InlineExtension)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"{param}.parrot: {exc} (an inline call takes only 'vars' and 'criteria': its "
                                 "session and waiting are its consumer's)", f"{param}.parrot") from None
        body = {k: v for k, v in raw.items() if k not in ("parrot", "stream", "stream_options")}
        path = f"{self.path}{name}"
        nested = InlineCalls(service, self.route, self.session, f"{path}.", self)
        inputs = service._bind(self.session, _placeholders(self.route, body), ext.vars, f"{param}.parrot.vars", nested)
        output = self.session.new_variable(name)
        self.outputs[path] = output
        latency = (ext.criteria or tier_criteria(body)) == "latency"
        service._extension_call(self.route, body, self.session, inputs, output, latency, reply=None)
        return output

    def _declare(self, param: str) -> None:
        """Counts one more inline call of the request, refusing it beyond the count or depth limits."""
        config = self.service.config
        if self.request.declared >= config.max_inline_calls:
            raise InvalidRequest(f"more than {config.max_inline_calls} inline calls in one request (the gateway's "
                                 "[semantic] max_inline_calls, nested ones counted); submit the rest as requests "
                                 "of their own", param)
        if self.depth > config.max_inline_depth:
            raise InvalidRequest(f"inline calls nested more than {config.max_inline_depth} deep (the gateway's "
                                 "[semantic] max_inline_depth); submit the inner ones as requests of their own",
                                 param)
        self.request.declared += 1


def _checked(gateway: Gateway, schema: type, raw: Any, param: str) -> Any:
    """``raw`` as a request of ``schema``, held to the gateway's rules as a request of its own is."""
    try:
        data = msgspec.convert(raw, schema)
        gateway.check(data)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"{param}: {exc}", _within(param, invalid_field(exc))) from None
    except InvalidRequest as exc:
        raise InvalidRequest(f"{param}: {exc}", _within(param, exc.param)) from None
    except DomainError as exc:  # a configured limit, an unknown model
        exc.param = _within(param, exc.param)
        raise
    return data


def _named_ids(extension: Any) -> set[str]:
    """The variable ids an extension names (``{"id": ...}`` in its vars, its inline calls' and its output)."""
    found, stack = set(), [extension]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            if isinstance(item.get("id"), str):
                found.add(item["id"])
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return found


def _placeholders(route: Route, body: dict[str, Any]) -> set[str]:
    return {name for text in texts(route, body) for name in template.names(text)}


def _within(prefix: str, param: str | None) -> str:
    return f"{prefix}.{param}" if param else prefix


def _as_stream(route: Route, answer: dict[str, Any], include_usage: bool, headers: dict[str, str]) -> Response:
    """A finished semantic request as an OpenAI stream (one chunk per choice), for clients that asked to stream."""
    chunk_object = "text_completion" if route == "completions" else "chat.completion.chunk"

    async def events() -> AsyncIterator[bytes]:  # read by other APIs too (chat_path.chunks_of), not only sent
        base = {"id": answer["id"], "object": chunk_object, "created": answer["created"], "model": answer["model"]}
        for choice in answer["choices"]:
            streamed = {"index": choice["index"], "finish_reason": choice["finish_reason"],
                        "logprobs": choice.get("logprobs")}
            if route == "completions":
                streamed["text"] = choice["text"]
            else:
                streamed["delta"] = _delta(choice["message"])
            yield sse_event(msgspec.json.encode({**base, "choices": [streamed], "parrot": answer["parrot"]}))
        if include_usage and answer.get("usage"):
            yield sse_event(msgspec.json.encode({**base, "choices": [], "usage": answer["usage"]}))
        yield SSE_DONE

    return EventStream(events(), media_type="text/event-stream", headers={"cache-control": "no-cache", **headers})


def _delta(message: dict[str, Any]) -> dict[str, Any]:
    """A whole chat message as one streamed delta: content, or tool calls with their stream indices."""
    delta = {"role": "assistant", "content": message.get("content")}
    if message.get("tool_calls"):
        delta["tool_calls"] = [{"index": i, **call} for i, call in enumerate(message["tool_calls"])]
    return delta
