"""The handoff, the gateway's side: a call whose inputs are still being generated is sent ahead to the
engine generating them, which starts it as soon as they are produced, their text put into its prompt
there (engines/builtin/serving/named_outputs.py is the engine's side).

Every forked generation is given an ``output_id`` and its output variable a ``PendingOutput`` naming it
while it runs (announced to consumers once it generates: a call sent ahead is announced when its own
inputs are bound, so a long chain goes ahead one call at a time, not all at once). A consumer whose every
unready input is pending on one engine does not wait for their text here: its prompt's rest goes to that
engine as parts, constant text and ready values as text, pending values as ``output_of``. The gateway
still binds every variable from its producer's answer, for readers and for consumers elsewhere. If a
producer fails, or is retried on another engine, its pending output is withdrawn and the consumers sent
ahead are called back to run the ordinary way, from the text.

The prompt is the one a plain request sends: the engine tokenizes the context's text, the parts and the
outputs' text as one text (engines/builtin/splicing.py heals each seam), never the producers' ids.
"""

from __future__ import annotations

import asyncio
import time
from typing import TYPE_CHECKING, Awaitable, Iterable, TypeVar

from engines.seam import ForkPart, PromptSplit

if TYPE_CHECKING:
    from gateway.semantic.graph import Variable

T = TypeVar("T")


class PendingOutput:
    """A value being generated on engine ``engine_id`` under ``output_id``."""

    def __init__(self, engine_id: str, output_id: str):
        self.engine_id = engine_id
        self.output_id = output_id
        self.withdrawn = asyncio.Event()  # its generation failed there: consumers sent ahead fall back


async def announced_inputs(inputs: dict[str, Variable], timeout_s: float) -> dict[str, str | PendingOutput] | None:
    """Each input's value, or its pending output, once every input has one of them; None when one failed,
    timed out or was withdrawn (the ordinary path then reports or waits as it does)."""
    known: dict[str, str | PendingOutput] = {}
    deadline = time.monotonic() + timeout_s
    for name, variable in inputs.items():
        try:
            await variable.announced(max(0.0, deadline - time.monotonic()))
        except TimeoutError:
            return None
        if variable.value is not None:
            known[name] = variable.value
        elif variable.pending is not None:
            known[name] = variable.pending
        else:
            return None
    return known


def fork_parts(split: PromptSplit, values: dict[str, str], pending: dict[str, PendingOutput]) -> list[ForkPart]:
    """The split's rest as parts: text (constant text and ready values run together), and each pending
    value as the output it will be."""
    parts: list[ForkPart] = []
    text = ""
    for segment in split.rest:
        if segment.variable is not None and segment.variable in pending:
            if text:
                parts.append(ForkPart(text=text))
                text = ""
            parts.append(ForkPart(output_of=pending[segment.variable].output_id))
        elif segment.variable is not None:  # a placeholder no input binds ({{output:x}}) stays text, as ordinarily
            text += values.get(segment.variable, "{{" + segment.variable + "}}")
        else:
            text += segment.text
    if text:
        parts.append(ForkPart(text=text))
    return parts


async def unless_withdrawn(work: Awaitable[T], pending: Iterable[PendingOutput], *,
                           beside: Awaitable[None]) -> tuple[T | None, bool]:
    """``work``'s result, or (None, True) once one of ``pending`` is withdrawn first (``work`` cancelled);
    ``beside`` runs meanwhile, cancelled when they end."""
    task = asyncio.ensure_future(work)
    watchers = [asyncio.ensure_future(p.withdrawn.wait()) for p in pending]
    side = asyncio.ensure_future(beside)
    try:
        await asyncio.wait([task, *watchers], return_when=asyncio.FIRST_COMPLETED)
    finally:
        for watcher in watchers:
            watcher.cancel()
        side.cancel()
        if not task.done():
            task.cancel()
            await asyncio.wait([task])  # its end, not its error; a cancellation of ours still propagates
    if task.cancelled():
        return None, True
    return task.result(), False
