"""Variables, the calls that produce and consume them, and the sessions that own both.

The graph is implicit: a ``Call`` points at its input and output ``Variable``s and a variable at
its producer, so an edge exists exactly when a call consumes what another produces. A call
leaves the graph when it finishes (its session keeps a ``CallNode`` of it, ids and timings only, for
the graph view); variables stay (their values are still read) until their session is deleted.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import secrets
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Protocol

from engines.seam import EngineError
from gateway.config import QuotaLimits
from gateway.domain_errors import Conflict, DomainError, Invalid, NotFound, NotReady, QuotaExceeded, TooLarge
from gateway.errors import engine_error_body
from gateway.scheduler import Placement, Warmed
from gateway.semantic.handoff import PendingOutput
from gateway.semantic.holdings import Holdings
from gateway.semantic.schema import CallNode, CallState
from wire.sampling import affinity_key

if TYPE_CHECKING:
    from gateway.semantic.call_spec import CallSpec

LATENCY_PRIORITY = 1 << 20  # above any app-FIFO rank
_arrivals = itertools.count()


def new_id(prefix: str) -> str:
    return f"{prefix}_{secrets.token_urlsafe(16)}"  # unguessable: ids are capabilities within a key


class VariableFailed(Exception):
    pass


def utf8_size(text: str) -> int:
    return len(text) if text.isascii() else len(text.encode())  # isascii is O(1) in CPython


class Variable:
    def __init__(self, session: "Session", name: str | None, value: str | None = None, *, var_id: str | None = None):
        self.id = var_id or new_id("var")
        self.session = session
        self.name = name
        self.value = value
        self.error: str | None = None
        self.producer: Call | None = None
        self.remote_producer: str | None = None  # its producer's id when another replica (or a lost process) runs it
        self.size = 0  # UTF-8 bytes of its value, counted in its session's bytes
        self.pending: PendingOutput | None = None  # while its producer generates it on an engine (handoff.py)
        self.partial = ""  # what its producer streamed of it so far, until it is bound (prefill.py extends with it)
        self._grew = asyncio.Event()  # set (and replaced) each time partial grows, and when it is bound or fails
        self._ready = asyncio.Event()
        self._announced = asyncio.Event()  # ready, or pending on an engine
        self._produced = asyncio.Event()  # ready, or its producer running (prefill.py's next in line)
        if value is not None:
            self._ready.set()
            self._announced.set()
            self._produced.set()

    @property
    def ready(self) -> bool:
        return self._ready.is_set()

    def set(self, value: str) -> None:
        """Binds the value (a 413 or 429 instead when it would take the session over its byte quotas)."""
        self.size = self.session.reserve_bytes(value)
        self.value = value
        self.pending = None
        self._ready.set()
        self._announced.set()
        self._produced.set()
        self._grown()
        self.session.changed(self)

    def extend(self, text: str) -> None:
        """Its producer streamed ``text`` more of it from its engine (it is not bound until the producer ends)."""
        self.partial += text
        self._grown()

    def _grown(self) -> None:
        if self.ready:
            self.partial = ""
        self._grew.set()
        self._grew = asyncio.Event()

    async def grown(self, chars: int, timeout_s: float) -> None:
        """Returns once ``partial`` holds at least ``chars`` characters, or the variable is ready (bound or failed);
        TimeoutError after ``timeout_s``."""
        async with asyncio.timeout(timeout_s):
            while len(self.partial) < chars and not self.ready:
                await self._grew.wait()

    def fail(self, error: str) -> None:
        self.error = error
        self.withdraw()
        self._ready.set()
        self._announced.set()
        self._produced.set()
        self._grown()
        self.session.changed(self)

    def settled_elsewhere(self, value: str | None, error: str | None) -> None:
        """Bound by another replica (or before a restart), as the state store tells: ready here too, its bytes
        counted in its session's without its quota (it was held to it where it was bound)."""
        if self.ready:
            return
        if value is not None:
            self.size = utf8_size(value)
            self.session.bytes += self.size
        self.value, self.error = value, error
        self._ready.set()
        self._announced.set()
        self._produced.set()
        self._grown()

    @property
    def producer_id(self) -> str | None:
        return self.producer.id if self.producer is not None else self.remote_producer

    def publish(self, pending: PendingOutput, *, generating: bool) -> None:
        """Its producer sent its generation to an engine under ``pending``'s name; ``generating``: the
        generation runs (its own inputs are there). Only then is it announced to consumers: a call sent
        ahead holds a connection and engine state while it waits, so a chain goes ahead one call at a time."""
        self.pending = pending
        if generating:
            self.generating()

    def generating(self) -> None:
        """The published generation now runs on its engine: consumers placed there may take it from there."""
        if self.pending is not None:
            self._announced.set()

    def settle(self, pending: PendingOutput) -> None:
        """The generation ended: what the gateway binds next is its value (the engine keeps the output a
        while, but not forever, so late consumers take the value)."""
        if self.pending is pending:
            self.pending = None

    def withdraw(self) -> None:
        """What was published is not coming from there: consumers sent ahead for it fall back."""
        if self.pending is not None:
            self.pending.withdrawn.set()
            self.pending = None

    def producing(self) -> None:
        """Its producer started running (sent to an engine with its inputs bound)."""
        self._produced.set()

    async def being_produced(self, timeout_s: float) -> None:
        """Returns once the variable is ready, or its producer runs (TimeoutError after ``timeout_s``). One with no
        producer here (the client binds it) counts as produced: nothing says when its value comes."""
        if self.producer is not None and not self._produced.is_set():
            await asyncio.wait_for(self._produced.wait(), timeout_s)

    async def announced(self, timeout_s: float) -> None:
        """Returns once the variable is ready, or generating on an engine (TimeoutError after ``timeout_s``)."""
        if not self._announced.is_set():
            await asyncio.wait_for(self._announced.wait(), timeout_s)

    async def get(self, timeout_s: float, *, waited_s: float | None = None) -> str:
        """Its value once ready; NotReady after ``timeout_s``, naming ``waited_s`` (the whole wait, when
        ``timeout_s`` is what was left of it) as how long it waited."""
        try:
            if not self.ready:  # wait_for with no time left times out even on a set event
                await asyncio.wait_for(self._ready.wait(), timeout_s)
        except asyncio.TimeoutError:
            who = f"its producer {self.producer_id} has not finished" if self.producer_id else "nothing produces it"
            waited = timeout_s if waited_s is None else waited_s
            raise NotReady(f"variable {self.label} was not ready within {waited:g}s: {who}",
                           code="variable_timeout", error_type="timeout") from None
        if self.error is not None:
            raise VariableFailed(self.error)
        assert self.value is not None
        return self.value

    @property
    def label(self) -> str:
        return f"{self.name!r} ({self.id})" if self.name else self.id


class CallTimings:
    """Where a call's time went, as Unix seconds (None: did not happen, or is not known): its prompt warmed
    ahead, its (first) request sent to its engine, its first token back (when its text was streamed from the
    engine), its (last) answer back. With the call's submitted / started / finished and its producers'
    finished, a benchmark splits its time into waiting for inputs, the gap after them, the gateway's own,
    queue and prefill, and decode (benchmarks/breakdown.py)."""

    __slots__ = ("warmed", "dispatched", "first_token", "answered")

    def __init__(self) -> None:
        self.warmed: float | None = None
        self.dispatched: float | None = None
        self.first_token: float | None = None
        self.answered: float | None = None

    def dispatch(self, at: float | None = None) -> None:
        if self.dispatched is None:
            self.dispatched = at or time.time()

    def token(self) -> None:
        if self.first_token is None:
            self.first_token = time.time()


class CallRunner(Protocol):
    """What runs a call's requests on engines (runner.py's ``Runner``)."""

    async def warm(self, call: Call) -> None:
        """While its inputs are not ready: what can be done before (its shared prefix filled)."""

    async def run_ahead(self, call: Call) -> dict[str, str] | None:
        """Its outputs, run on the engine generating its inputs before they are bound here (handoff.py);
        None when it cannot go ahead (it then waits for its inputs' values)."""

    async def run(self, call: Call, values: dict[str, str]) -> dict[str, str]:
        """Its outputs, run with its inputs' ``values``."""


class Call:
    """One request in the graph: waits for its inputs, has ``runner`` run its ``spec``, binds its outputs."""

    def __init__(self, session: "Session", inputs: dict[str, Variable], outputs: dict[str, Variable],
                 spec: CallSpec, runner: CallRunner, *, latency: bool, call_id: str | None = None):
        self.id = call_id or new_id("call")
        self.spec: CallSpec | None = spec  # what it runs (None once it ended: its request and reply let go)
        self.runner = runner
        self.session = session
        self.inputs = inputs
        self.outputs = outputs
        self.latency = latency
        self.grouped = False  # a member of task groups only: finishing before its peers gains nothing
        self.group: str | None = None  # when grouped: its task group (named by its first consumer)
        self.task: asyncio.Task[dict[str, str]] | None = None
        # What the graph view shows; set where they happen (a few stores, nothing on the way computed).
        self.state: CallState = "waiting"
        self.submitted = time.time()
        self.started: float | None = None  # when its inputs were ready and its work began (None: pending)
        self.handed: float | None = None  # when it was sent to its engine ahead of its inputs (handoff.py)
        self.span_context = None  # its tracing span's, once it ran traced (gateway/tracing.py)
        self.finished: float | None = None
        self.engine_id: str | None = None  # set by the runner once the scheduler placed it
        self.warmed: Warmed | None = None  # where its prompt was prefilled ahead of its inputs, how far (prefill.py)
        self.timings = CallTimings()
        self.error: str | None = None

    def node(self) -> CallNode:
        return CallNode(id=self.id, state=self.state, criteria="latency" if self.latency_critical else "throughput",
                        group=self.group, engine=self.engine_id,
                        inputs={name: v.id for name, v in self.inputs.items()},
                        outputs={name: v.id for name, v in self.outputs.items()},
                        submitted=self.submitted, handed=self.handed, started=self.started, finished=self.finished,
                        error=self.error, warmed=self.timings.warmed, dispatched=self.timings.dispatched,
                        first_token=self.timings.first_token, answered=self.timings.answered)

    @property
    def priority(self) -> int:
        """Latency-critical first; otherwise app-FIFO: calls of earlier sessions (apps) go first."""
        return (LATENCY_PRIORITY if self.latency else 0) - self.session.arrival

    def engine_hints(self) -> dict[str, Any]:
        """How a builtin engine should schedule this call's requests: its place in line, and whether it
        may wait for a big batch. A task group's members are batched together even when urgent: their
        consumer waits for the last of them, so they must finish together, not one after another."""
        return {"priority": self.priority, "criteria": "latency" if self.latency_critical else "throughput"}

    def placement(self, body: dict[str, Any] | None = None) -> Placement:
        """How the global scheduler should place this call's requests (engine_hints: the engine's part); with
        the affinity key (``prompt_cache_key``) of ``body``, the request one of its steps sends."""
        return Placement(latency=self.latency_critical, group=self.group, urgent=self.latency,
                         affinity=affinity_key(body) if body is not None else None)

    @property
    def latency_critical(self) -> bool:
        """Someone waits on it and it is no task-group member (whose consumer waits for its peers too)."""
        return self.latency and not self.grouped

    def mark_latency(self) -> None:
        """Someone waits on this call's result: it and everything it transitively needs become urgent.
        (A walk, not a recursion: chains may be thousands of calls deep.)"""
        pending = [self]
        while pending:
            call = pending.pop()
            if call.latency:
                continue
            call.latency = True
            pending.extend(v.producer for v in call.inputs.values() if v.producer is not None)

    def _feeds_only_task_groups(self, consumers: list["Call"]) -> bool:
        """Whether every consumer of this call also waits for inputs that other calls or the client
        produce: finishing this call first would not start any of them sooner."""
        return bool(consumers) and all(
            any(not v.ready and v.producer is not self for v in consumer.inputs.values()) for consumer in consumers)

    def consumers(self) -> list["Call"]:
        return [consumer for output in self.outputs.values() for consumer in self.session.consumers_of(output)]

    @staticmethod
    def group_peers(consumers: list["Call"]) -> set["Call"]:
        """Producers feeding ``consumers`` (this call's): they are scheduled together."""
        peers: set[Call] = set()
        for consumer in consumers:
            peers |= {v.producer for v in consumer.inputs.values() if v.producer and v.producer.task}
        return peers

    async def _values(self, deadline: float, input_timeout_s: float) -> dict[str, str]:
        """Its inputs' values, all bound by ``deadline`` (``input_timeout_s`` after it was started)."""
        values = {}
        for name, variable in self.inputs.items():
            try:
                values[name] = await variable.get(max(0.0, deadline - time.monotonic()), waited_s=input_timeout_s)
            except VariableFailed as exc:
                raise VariableFailed(f"input {variable.label} failed: {_clipped(str(exc))}") from None
        return values

    def join_group(self) -> None:
        """Before it goes to an engine: it joins its task group (or runs alone), at the group's most urgent pace."""
        consumers = self.consumers()
        self.grouped = self._feeds_only_task_groups(consumers)
        self.group = consumers[0].id if self.grouped else None
        if any(peer.latency for peer in self.group_peers(consumers)):
            self.latency = True  # a task group runs at the pace of its most urgent member

    def mark_running(self) -> None:
        self.state, self.started = "running", time.time()
        for output in self.outputs.values():
            output.producing()  # its consumers are next in line now (prefill.py)

    def hand_to_engine(self) -> None:
        """It goes to an engine before its inputs are ready (the handoff): it is waiting there, and
        running from when its inputs are bound."""
        self.join_group()
        self.handed = time.time()

    async def run(self, input_timeout_s: float) -> dict[str, str]:
        deadline = time.monotonic() + input_timeout_s  # for its inputs, however long going ahead took
        try:
            results = None
            if not all(variable.ready for variable in self.inputs.values()):
                await self.runner.warm(self)
                results = await self.runner.run_ahead(self)
                if results is None:
                    self.handed = None  # it runs the ordinary way after all
            if results is None:
                values = await self._values(deadline, input_timeout_s)
                self.join_group()
                self.mark_running()
                results = await self.runner.run(self, values)
            if self.session.mirror is not None:  # published once: a call run twice (taken over) binds one value
                results = await self.session.mirror.published(self, results)
            self.state = "done"
        except BaseException as exc:
            message = _describe(exc)
            self.state = "cancelled" if isinstance(exc, asyncio.CancelledError) else "failed"
            self.error = _clipped(message, 500)
            for output in self.outputs.values():
                output.fail(f"producer {self.id} failed: {message}")
            self.session.call_ended(self)
            raise
        finally:
            self.finished = time.time()
            self.session.calls.pop(self.id, None)  # finished parts of the graph are freed,
            self.session.keep_finished(self)  # but for what the graph view shows of them;
            self.spec = None  # with its request and reply
        for name, output in self.outputs.items():
            try:
                output.set(results[name])
            except (TooLarge, QuotaExceeded) as exc:  # over its session's byte quotas: the output fails, not the gateway
                output.fail(f"producer {self.id}: {exc.message}")
        self.session.call_ended(self)
        return results


class Session:
    def __init__(self, owner: str, index: dict[str, Variable], *, default: bool = False,
                 max_variables: int | None = None, limits: QuotaLimits | None = None,
                 finished_calls_kept: int = 1000, holdings: Holdings | None = None, session_id: str | None = None):
        self.id = session_id or new_id("sess")
        # Where its variables are written through to (gateway/semantic/persisted.py); None: this process only.
        self.mirror: Any = None
        self._index = index  # the store's id -> variable map, for lookups without a session id
        self.owner = owner
        self.default = default
        # A key's default session is not deleted by its client: it keeps its newest variables only.
        self.max_variables = max_variables
        self.limits = limits or QuotaLimits()  # its owner's: variables, bytes per variable and in all
        self.holdings = holdings or Holdings(self.limits)  # its owner's, shared by the owner's sessions
        self.bytes = 0  # of its variables' values
        self.last_used = time.monotonic()  # the last request that touched it, or the sweep that saw it busy
        self.created = int(time.time())
        self.arrival = next(_arrivals)
        self.variables: dict[str, Variable] = {}
        self.calls: dict[str, Call] = {}
        self.finished_calls: OrderedDict[str, CallNode] = OrderedDict()  # the latest, for the graph view
        self.finished_calls_kept = finished_calls_kept
        self.prefix_keys: set[str] = set()  # shared prefixes this session pinned on engines
        self.closed = False
        self.cancelled_tasks: list[asyncio.Task] = []  # its calls' tasks, cancelled when it closed
        self._made_by_request: int | None = None  # inside undo_on_error: how many variables its request made

    def new_variable(self, name: str | None = None, value: str | None = None) -> Variable:
        limit = self.limits.variables_per_session
        if not self.default and limit is not None and len(self.variables) >= limit:
            if self._made_by_request is not None and self._made_by_request >= limit:
                raise Invalid(f"this request makes more than {limit} variables, this API key's quota for a "
                              "whole session: it can never fit; split it", code="too_many_variables")
            raise QuotaExceeded(f"session {self.id} already holds {limit} variables, this API key's quota; "
                                "delete sessions you no longer need", code="variables_quota_exceeded")
        size = self.reserve_bytes(value) if value is not None else 0
        variable = Variable(self, name, value)
        variable.size = size
        if self._made_by_request is not None:
            self._made_by_request += 1
        self.variables[variable.id] = variable
        self._index[variable.id] = variable
        self.changed(variable)
        if self.max_variables is not None and len(self.variables) > self.max_variables:
            self._forget_oldest(len(self.variables) - self.max_variables * 9 // 10)
        return variable

    def reserve_bytes(self, value: str) -> int:
        """Counts ``value`` in this session's bytes and returns its size; a 413 (it can never fit) or a
        429 (the session is full) instead when over quota. A default session forgets old variables."""
        size = utf8_size(value)
        limit = self.limits.bytes_per_variable
        if limit is not None and size > limit:
            raise TooLarge(f"a variable's value is {size} bytes, above this API key's quota of {limit}",
                           code="variable_too_large")
        limit = self.limits.bytes_per_session
        if limit is not None and self.bytes + size > limit:
            if self.default:
                self._forget_oldest(len(self.variables), until_bytes=limit - size)
            if self.bytes + size > limit:
                raise QuotaExceeded(f"session {self.id} holds {self.bytes} bytes of values; {size} more would "
                                    f"exceed this API key's quota of {limit}", code="session_bytes_quota_exceeded")
        self.bytes += size
        return size

    def _forget_oldest(self, count: int, until_bytes: int | None = None) -> None:
        """Forgets up to ``count`` of the oldest variables that nothing pending needs any more (stopping
        once the session holds at most ``until_bytes``)."""
        needed = {id(v) for call in self.calls.values() for v in (*call.inputs.values(), *call.outputs.values())}
        forgettable = [v for v in self.variables.values() if v.ready and id(v) not in needed][:count]
        if until_bytes is not None:
            excess, chosen = self.bytes - until_bytes, []
            for variable in forgettable:
                if excess <= 0:
                    break
                chosen.append(variable)
                excess -= variable.size
            forgettable = chosen
        self._forget([v.id for v in forgettable])

    def _forget(self, var_ids: Iterable[str]) -> None:
        var_ids = list(var_ids)
        for var_id in var_ids:
            self.bytes -= self.variables.pop(var_id).size
            self._index.pop(var_id, None)
        if self.mirror is not None and var_ids:
            self.mirror.forgotten(self, var_ids)

    def changed(self, variable: Variable) -> None:
        """The variable was made, bound, failed or given a producer: written through to the state store."""
        if self.mirror is not None:
            self.mirror.changed(self, variable)

    def call_ended(self, call: Call) -> None:
        """Its outputs are bound or failed: it leaves the state store's calls (written after its outputs)."""
        if self.mirror is not None:
            self.mirror.call_ended(call)

    def adopt(self, variable: Variable) -> None:
        """A variable of this session read from the state store (made by another replica, or before a restart)."""
        self.variables[variable.id] = variable
        self._index[variable.id] = variable

    def variable(self, var_id: str) -> Variable:
        variable = self.variables.get(var_id)
        if variable is None:
            raise NotFound(f"variable {var_id!r} not found in session {self.id}", code="variable_not_found")
        return variable

    def keep_finished(self, call: Call) -> None:
        """Remembers what the graph view shows of a finished call (ids, not values), the latest few only."""
        if self.closed or not self.finished_calls_kept:
            return
        self.finished_calls[call.id] = call.node()
        if len(self.finished_calls) > self.finished_calls_kept:
            self.finished_calls.popitem(last=False)

    def consumers_of(self, variable: Variable) -> list[Call]:
        return [c for c in self.calls.values() if variable in c.inputs.values()]

    def add_call(self, call: Call, input_timeout_s: float) -> None:
        """Link the call into the graph (rejecting cycles and double producers) and start it."""
        for output in call.outputs.values():
            if output.producer is not None or output.ready:
                raise Conflict(f"variable {output.label} already has a value or a producer",
                               param="parrot.output", code="variable_already_bound")
        if _reaches(call.inputs.values(), set(call.outputs.values())):
            raise Invalid(f"call {call.id} would close a cycle: one of its outputs is among its own "
                          "transitive inputs", param="parrot.vars", code="cycle")
        self.holdings.add_call()
        if self.mirror is not None:  # recorded (and leased) before its outputs name it as their producer
            self.mirror.call_added(call)
        if call.latency or any(consumer.latency for consumer in call.consumers()):
            call.latency = False  # someone waits on it, or on what it feeds: it and its producers are urgent
            call.mark_latency()
        for output in call.outputs.values():
            output.producer = call
            self.changed(output)
        self.calls[call.id] = call
        call.task = asyncio.get_running_loop().create_task(call.run(input_timeout_s), name=call.id)
        call.task.add_done_callback(_consume_exception)
        call.task.add_done_callback(lambda _: self.holdings.call_ended())  # however it ends, cancelled unstarted too

    @contextlib.contextmanager
    def undo_on_error(self) -> Iterator[set[str]]:
        """Variables made and calls added by a request that is then rejected are forgotten again (the block
        must not await, so the calls' tasks have not begun). Yields a set that holds, after the block, the ids
        of the variables it made."""
        before, calls_before, made = set(self.variables), set(self.calls), set()
        self._made_by_request = 0
        try:
            yield made
        except BaseException:
            for call_id in self.calls.keys() - calls_before:
                call = self.calls.pop(call_id)
                if call.task is not None:
                    call.task.cancel()
                self.call_ended(call)  # it never ran: nobody takes it over
            self._forget(self.variables.keys() - before)
            raise
        finally:
            self._made_by_request = None
        made |= self.variables.keys() - before

    def forget(self, var_ids: Iterable[str]) -> None:
        """Forgets those of the variables still known (a default session may have dropped some already)."""
        self._forget([var_id for var_id in var_ids if var_id in self.variables])

    def close(self) -> int:
        """Cancel running calls, wake whoever waits on a variable, and forget every variable; returns
        how many. Their values are freed now, not at the next cyclic garbage collection: variables
        point at their session and producer, so the session must let go of them and they of those."""
        self.closed = True
        self.cancelled_tasks = [call.task for call in self.calls.values() if call.task is not None]
        for task in self.cancelled_tasks:
            task.cancel()
        self.calls.clear()
        self.finished_calls.clear()
        for var_id, variable in self.variables.items():
            if not variable.ready:
                variable.fail(f"session {self.id} was deleted")
            variable.producer = None
            self._index.pop(var_id, None)
        freed = len(self.variables)
        self.variables.clear()
        self.bytes = 0
        return freed


def _reaches(inputs, targets: set[Variable]) -> bool:
    seen: set[int] = set()
    stack = list(inputs)
    while stack:
        variable = stack.pop()
        if variable in targets:
            return True
        if id(variable) in seen or variable.producer is None:
            continue
        seen.add(id(variable))
        stack.extend(variable.producer.inputs.values())
    return False


def _clipped(message: str, limit: int = 2000) -> str:
    """A failure carried down a chain names every producer on the way: clipped, it stays linear in size."""
    return message if len(message) <= limit else f"{message[:limit // 2]} … {message[-limit // 2:]}"


def _describe(exc: BaseException) -> str:
    if isinstance(exc, DomainError):
        return exc.message
    if isinstance(exc, EngineError):
        return f"{exc} ({engine_error_body(exc).message})" if exc.body else str(exc)
    if isinstance(exc, asyncio.CancelledError):
        return "cancelled"
    return str(exc) or type(exc).__name__


def _consume_exception(task: asyncio.Task) -> None:
    if not task.cancelled():
        task.exception()  # failures live on in the output variables; don't log them as unretrieved
