"""Runs calls on engines (graph.py's ``CallRunner``): a call's steps in order, each forked from its shared
prefix on an engine with contexts (forks.py), else run as a plain request with its values substituted
(plain.py). A waiting call is warmed (its prefix filled ahead as a context, or prefilled on an upstream that
takes prefill-only requests: prefill.py), and one whose inputs are generating on one builtin engine is sent
ahead there (handoff.py). Each step's answer goes to the call's reply, if it has one.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

from engines.seam import EngineError, Generation, PromptSplit
from gateway.attempts import retryable
from gateway.config import SemanticConfig
from gateway.registry import EngineRecord
from gateway.scheduler import Placement
from gateway.semantic.answer import Answer, usage_of
from gateway.semantic.call_spec import Step
from gateway.semantic.forks import Forks, Handoff, Plan
from gateway.semantic.gateway_port import GatewayPort
from gateway.semantic.graph import Call
from gateway.semantic.handoff import unless_withdrawn
from gateway.semantic.plain import run_plain
from gateway.semantic.prefill import Prefills
from gateway.semantic.prefix import PrefixCache
from gateway.semantic.streaming import TextSink
from gateway.tracing import Tracing


class Runner:
    def __init__(self, gateway: GatewayPort, prefixes: PrefixCache, config: SemanticConfig, tracing: Tracing,
                 kv_full: float = 0.95, rewarm: bool = True):
        self.gateway = gateway
        self.forks = Forks(gateway, prefixes, config.min_prefix_chars)
        self.prefills = Prefills(gateway, config, kv_full, rewarm)
        self.config = config
        self.tracing = tracing

    async def warm(self, call: Call) -> None:
        """Its first step's prompt, up to its first pending input, made ready on the engine it will run on: the
        constant prefix filled as a context on an engine with contexts (forks.py), else prefilled on an engine
        that takes prefill-only requests (prefill.py), whose prefix cache keeps it."""
        if not call.spec.warm:
            return
        first = call.spec.steps[0]
        if self.forks.engines(first.body["model"]):
            await self.forks.warm(first, call)
        else:
            await self.prefills.warm(first, call)

    async def run(self, call: Call, values: dict[str, str]) -> dict[str, str]:
        self.prefills.forget(call)  # its inputs came: what was warmed for it is no longer watched
        with self.tracing.call(call):
            return await self._steps(call, values)

    async def run_ahead(self, call: Call) -> dict[str, str] | None:
        """The call's first step sent ahead to the engine generating its inputs, the rest run as usual; None
        when it cannot go ahead (the call then waits for its inputs' values)."""
        if not self.config.token_handoff:
            return None
        first = call.spec.steps[0]
        handoff = await self.forks.plan_ahead(first, call, self.config.input_timeout_s)
        if handoff is None:
            return None
        with self.tracing.call(call):
            answer = await self._run_ahead(first, handoff, call)
            if answer is None:
                return None
            values = {name: v.value for name, v in call.inputs.items() if v.value is not None}  # all bound by now
            return await self._steps(call, values, ahead=answer)

    async def _steps(self, call: Call, values: dict[str, str], ahead: Answer | None = None) -> dict[str, str]:
        """The call's steps in order, each seeing the values and the outputs before it; ``ahead``: the first
        step's answer, when it ran ahead."""
        results: dict[str, str] = {}
        known = dict(values)
        for i, step in enumerate(call.spec.steps):
            answer = ahead if i == 0 and ahead is not None else await self._run(step, known, call)
            if call.spec.reply is not None:
                call.spec.reply.answer = answer  # its last step's stays
            known[step.output] = results[step.output] = answer.text
        return results

    async def _run(self, step: Step, values: dict[str, str], call: Call) -> Answer:
        """Runs ``step`` with ``values``, placed by the global scheduler."""
        started = time.perf_counter()
        hints, placement = call.engine_hints(), call.placement(step.body)  # as the call stands when the step starts
        records = self.forks.engines(step.body["model"])
        split = await self.forks.split(step, records) if records and self.forks.forkable(step) else None
        if split is not None:
            return await self._fork(step, call, split, split.rest_with(values), records, hints, placement, started)
        if call.warmed is not None and call.spec is not None and step is call.spec.steps[0]:
            placement = placement._replace(warmed=call.warmed)  # where its prefix was prefilled: it runs there
        answer = await run_plain(self.gateway, step, values, hints, placement, _sink(call), call.timings,
                                 stream=self.config.stream_steps or self.config.prefill_extend_chars > 0,
                                 output=call.outputs[step.output])
        call.engine_id = answer.engine_id
        call.timings.answered = time.time()
        return answer

    async def _fork(self, step: Step, call: Call, split: PromptSplit, rest: str, records: list[EngineRecord],
                    hints: dict[str, Any], placement: Placement, started: float) -> Answer:
        """``step`` forked from ``split``'s prefix; one that fails on an engine is run again on another while
        nothing of it reached anyone."""
        model, sink = step.body["model"], _sink(call)
        bounded = hints | self.gateway.token_defaults(step.route, step.body, records[0].engine)  # as plainly
        tried: set[str] = set()
        while True:
            plan = self.forks.place(model, split, rest, records, placement)
            call.engine_id = plan.record.id
            call.timings.dispatch()
            try:
                generation = await self.forks.generate(plan, rest, step.body, bounded, call.session, sink,
                                                       call.outputs[step.output], generating=True,
                                                       timings=call.timings)
                break
            except EngineError as exc:
                tried.add(plan.record.id)
                records = [r for r in self.forks.engines(model) if r.id not in tried]
                if (not retryable(exc) or not records or len(tried) > self.gateway.retries
                        or (sink is not None and sink.started)):
                    self.gateway.outcomes.failed(model, exc)
                    raise
        call.timings.answered = time.time()
        return self._answered(step, plan, generation, started)

    async def _run_ahead(self, step: Step, handoff: Handoff, call: Call) -> Answer | None:
        """Runs ``step`` as ``handoff`` plans; None when a producer was withdrawn or failed on the engine
        before this produced anything (the caller then runs it from its inputs' text, as usual)."""
        started = time.perf_counter()
        call.hand_to_engine()
        plan, sink, output = handoff.plan, _sink(call), call.outputs[step.output]
        timeout_s = self.config.input_timeout_s
        call.engine_id = plan.record.id
        bounded = call.engine_hints() | self.gateway.token_defaults(step.route, step.body, plan.engine)
        call.timings.dispatch()
        try:
            done, withdrawn = await unless_withdrawn(
                self.forks.generate(plan, handoff.parts, step.body, bounded, call.session, sink, output,
                                    generating=False, timings=call.timings),
                handoff.pending, beside=_running_once_bound(call, timeout_s))
        except EngineError as exc:
            if (exc.status_code == 424 or retryable(exc)) and not (sink is not None and sink.started):
                return None  # a producer failed there, or the engine did: run from the text (elsewhere)
            self.gateway.outcomes.failed(step.body["model"], exc)
            raise
        if not withdrawn:
            for variable in call.inputs.values():  # bound by their producers as their answers arrive
                await variable.get(timeout_s)  # a producer whose value failed (quotas) fails this call too
        if withdrawn or any(pending.withdrawn.is_set() for pending in handoff.pending):
            # A producer was run again elsewhere (its first answer lost): its value may differ from the tokens
            # this call took, so it runs again from the value, unless its text already reached a reader.
            output.withdraw()
            if sink is not None and sink.started:
                raise EngineError(f"an input of call {call.id} was produced again after the call began streaming")
            return None
        if call.started is None:
            call.mark_running()
        call.timings.answered = time.time()
        return self._answered(step, plan, done, started)

    def _answered(self, step: Step, plan: Plan, generation: Generation, started: float) -> Answer:
        model = step.body["model"]
        prompt_tokens, cached_tokens = generation.prompt_usage()
        usage = usage_of(prompt_tokens, len(generation.token_ids), cached_tokens)
        answer = Answer.generated(step.route, model, generation.text, generation.finish_reason, usage, plan.record.id)
        self.gateway.outcomes.succeeded(model, plan.record.engine.name, answer.body, started)  # as a plain request is
        return answer


def _sink(call: Call) -> TextSink | None:
    """Where the call's text streams to as it is generated, when its client asked for a stream."""
    return call.spec.reply.sink if call.spec.reply is not None else None


async def _running_once_bound(call: Call, timeout_s: float) -> None:
    """Marks a call sent ahead as running once its inputs are bound here (its engine started it then), and
    announces its outputs to their consumers, which may go ahead in turn."""
    with contextlib.suppress(Exception):
        for variable in call.inputs.values():
            await variable.get(timeout_s)
        call.mark_running()
        for output in call.outputs.values():
            output.generating()
