"""Generations' outputs kept by name, so that later requests can take them as input: the engine side of
the handoff between a DAG's producer and consumer calls.

A gateway running a DAG names a generation's output (``output_id``) and sends the call that consumes it
ahead of time, its fork text naming that output where the value goes (``ForkPart(output_of=...)``). The
consumer waits here, on the engine, and is queued for the step loop as soon as its producer's last token
is decoded: no round trip through the gateway. What it takes is the producer's text, the value a plain
request would have sent, tokenized together with the text around it (splicing.py): a producer's own token
ids are not always how its text tokenizes, nor how it tokenizes beside what precedes it.

Everything here runs on the engine's event loop (the HTTP app's), so it needs no lock.
"""

from __future__ import annotations

import asyncio
from collections import Counter, OrderedDict
from typing import NamedTuple

from engines.builtin.serving.errors import InputUnavailable, OutputTaken


class Output(NamedTuple):
    text: str  # what its generation answered
    step: int  # the engine step that produced its last token


class NamedOutputs:
    def __init__(self, max_kept: int = 4096, unclaimed_wait_s: float = 30.0):
        """``max_kept``: finished outputs remembered; the oldest are forgotten beyond (the gateway sends
        consumers while their producers run, and takes values once they end). ``unclaimed_wait_s``: how long
        a consumer waits for an output no generation has started producing (its producer's request may
        arrive after it) before it is refused: one whose producer never comes (refused before it started,
        or sent elsewhere) does not wait forever."""
        self._outputs: OrderedDict[str, asyncio.Future[Output]] = OrderedDict()
        self._producing: set[str] = set()
        self._waiting: Counter[str] = Counter()
        self.max_kept = max_kept
        self.unclaimed_wait_s = unclaimed_wait_s

    def __len__(self) -> int:
        return len(self._outputs)

    def begin(self, output_id: str) -> None:
        """A generation will produce ``output_id``; a name already produced or being produced is refused."""
        future = self._outputs.get(output_id)
        if output_id in self._producing or (future is not None and future.done()):
            raise OutputTaken(f"output_id {output_id!r} names another generation's output")
        self._producing.add(output_id)
        if future is None:
            self._outputs[output_id] = asyncio.get_running_loop().create_future()

    def produce(self, output_id: str, output: Output) -> None:
        self._settle(output_id, lambda future: future.set_result(output))

    def fail(self, output_id: str, why: str) -> None:
        def fail(future: asyncio.Future[Output]) -> None:
            future.set_exception(InputUnavailable(f"output {output_id!r} was not produced: {why}"))
            future.exception()  # retrieved: nobody may be waiting for it, which is no error

        self._settle(output_id, fail)

    def _settle(self, output_id: str, settle) -> None:
        self._producing.discard(output_id)
        future = self._outputs.get(output_id)
        if future is not None and not future.done():
            settle(future)
            self._outputs.move_to_end(output_id)
        self._forget_oldest()

    async def wait(self, output_id: str) -> Output:
        """The output once produced (at once if it was); InputUnavailable if its generation failed."""
        future = self._outputs.get(output_id)
        if future is None:  # its producer's request has not arrived yet
            future = self._outputs[output_id] = asyncio.get_running_loop().create_future()
        self._waiting[output_id] += 1
        try:
            while True:
                if output_id in self._producing:  # it comes: no timeout, and one hop fewer on the handoff's path
                    return await asyncio.shield(future)
                try:
                    return await asyncio.wait_for(asyncio.shield(future), self.unclaimed_wait_s)
                except TimeoutError:
                    if not future.done() and output_id not in self._producing:
                        raise InputUnavailable(f"no generation started producing output {output_id!r} within "
                                               f"{self.unclaimed_wait_s:g}s") from None
        finally:
            self._waiting[output_id] -= 1
            if not self._waiting[output_id]:
                del self._waiting[output_id]
                if not future.done() and output_id not in self._producing:
                    self._outputs.pop(output_id, None)  # nobody waits and nobody produces it

    def _forget_oldest(self) -> None:
        excess = len(self._outputs) - self.max_kept
        if excess <= 0:
            return
        done = [name for name, future in self._outputs.items() if future.done()][:excess]
        for name in done:
            del self._outputs[name]
