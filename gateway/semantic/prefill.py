"""Prefill ahead on engines without contexts (engines/seam ``PrefillEngine``: vLLM, SGLang with prefix caching).

The upstream counterpart of a context fill (forks.py's ``warm``): while a call waits for its inputs, its first
step's prompt up to the first input that is still pending (the inputs already bound substituted, as the plain
request will have them) is sent to the engine the global scheduler picks for the call, as one prefill-only
request; that engine's prefix cache keeps it. The call is then placed there (its placement names the engine as
holding its prefix), so when its inputs land only the rest of its prompt is computed. An engine already queueing
work (its stats) is not warmed: the prefill would wait in line with everything else and delay the work ahead of
it, for a prefix the call computes anyway. What the engine computed is its own to keep or evict; the answer is
the plain request's either way.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from engines.seam import EngineError, PrefillEngine, PrioritizedEngine, Route
from engines.seam.connect import has_capability
from gateway.prompt_prefix import prompt_prefix
from gateway.registry import EngineRecord
from gateway.scheduler import Work
from gateway.semantic import template
from gateway.semantic.call_spec import Step
from gateway.semantic.gateway_port import GatewayPort
from gateway.semantic.graph import Call
from wire.placeholders import PLACEHOLDER

logger = logging.getLogger(__name__)
_RENDERING = ("model", "tools", "chat_template", "chat_template_kwargs")  # what shapes a chat prompt beside messages


class Prefills:
    def __init__(self, gateway: GatewayPort, min_prefix_chars: int):
        self.gateway = gateway
        self.min_prefix_chars = min_prefix_chars

    def engines(self, model: str) -> list[EngineRecord]:
        """The healthy engines of ``model`` that take prefill-only requests."""
        return [r for r in self.gateway.engines_for(model) if has_capability(r.engine, PrefillEngine)]

    async def warm(self, step: Step, call: Call) -> None:
        """Prefills ``step``'s prompt up to its first pending input on the engine the call will run on, and
        remembers that engine on the call (``warmed_on``). Errors are left for the run itself to meet."""
        records = self.engines(step.body["model"])
        if not records:
            return
        values = {name: v.value for name, v in call.inputs.items() if v.value is not None}
        body = prefix_body(step.route, step.body, values)
        if body is None or _prefix_chars(step.route, body) < self.min_prefix_chars:
            return
        placement = call.placement(step.body)
        prefix, tokens = prompt_prefix(step.route, body)
        record = self.gateway.place(Work(prefix, tokens, placement), records)
        if record is None:
            return
        model = step.body["model"]
        if record.stats.waiting > 0:
            self.gateway.outcomes.prefilled(model, record.engine.name, skipped=True)
            return
        if has_capability(record.engine, PrioritizedEngine):
            body["priority"] = record.engine.priority_of(placement.level)  # type: ignore[attr-defined]
        call.warmed_on = record.id
        try:
            self.gateway.outcomes.prefilled(model, record.engine.name)
            await record.engine.prefill(step.route, body)  # type: ignore[attr-defined]
            call.timings.warmed = time.time()
        except EngineError as exc:
            logger.debug("prefill ahead of call %s on %r failed: %s", call.id, record.engine.name, exc)


def prefix_body(route: Route, body: dict[str, Any], values: dict[str, str]) -> dict[str, Any] | None:
    """``body`` cut where its first placeholder without a value in ``values`` starts, the others before it
    substituted: a completions prompt, or the chat messages before that one and that one's text up to it.
    None when nothing is pending (the request itself runs) or the prompt is not one such a cut keeps exact
    (several prompts, messages with parts other than text before the cut)."""
    if route == "completions":
        prompt = body.get("prompt")
        if not isinstance(prompt, str):
            return None
        cut = _cut(prompt, values)
        return None if cut is None else {"model": body["model"], "prompt": cut}
    messages: list[dict[str, Any]] = []
    for message in body.get("messages") or ():
        content = message.get("content")
        if not isinstance(content, str):
            if any(PLACEHOLDER.search(text) for text in _texts(content)):
                return None  # the cut would fall inside parts: not warmed
            messages.append(message)
            continue
        cut = _cut(content, values)
        if cut is None:
            messages.append({**message, "content": template.substitute(content, values)})
            continue
        if cut:
            messages.append({**message, "content": cut})
        if not messages:
            return None
        return {key: body[key] for key in _RENDERING if key in body} | {"messages": messages}
    return None


def _cut(text: str, values: dict[str, str]) -> str | None:
    """``text`` up to its first input placeholder without a value (those before it substituted); None if none."""
    for match in PLACEHOLDER.finditer(text):
        if match.group(1) != "output" and match.group(2) not in values:
            return template.substitute(text[:match.start()], values)
    return None


def _texts(content: Any) -> list[str]:
    if isinstance(content, list):
        return [part.get("text") or "" for part in content if isinstance(part, dict)]
    return []


def _prefix_chars(route: Route, body: dict[str, Any]) -> int:
    if route == "completions":
        return len(body["prompt"])
    return sum(len(m["content"]) if isinstance(m.get("content"), str) else 0 for m in body["messages"])
