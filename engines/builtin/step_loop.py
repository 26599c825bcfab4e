"""The engine's step loop on one background thread: ``step()`` = schedule -> run -> postprocess, and the
bridge that carries results to asyncio.

Threading: the public API (core.py) may be called from an asyncio loop on another thread; every change
to scheduler or block state happens under ``_lock``, which the loop holds while scheduling and
post-processing but not while the model runs. Requests only ever *mark* an in-flight context (abort);
the loop applies the change between steps, so the blocks of the batch being computed never change hands
mid-step. Results reach asyncio through ``loop.call_soon_threadsafe`` (``resolver``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Callable

import torch

from engines.builtin.block_manager import BlockManager
from engines.builtin.context import Context, Status
from engines.builtin.context_registry import ContextRegistry
from engines.builtin.kv_event_publisher import KVEventPublisher
from engines.builtin.cpu_affinity import ComputeThreads
from engines.builtin.model_runner import ModelRunner, ScheduledBatch, StepResult
from engines.builtin.prometheus_metrics import EngineMetrics
from engines.builtin.sampler import SampleResult
from engines.builtin.scheduler import Scheduler
from engines.builtin.types import TokenEvent

log = logging.getLogger(__name__)


class StepLoop:
    """The base of ``EngineCore``: the loop and its bookkeeping, over the parts the core builds."""

    registry: ContextRegistry
    scheduler: Scheduler
    block_manager: BlockManager
    runner: ModelRunner
    eos_token_ids: list[int]
    max_model_len: int
    metrics: EngineMetrics
    step_stall_timeout_s: float
    kv_events: KVEventPublisher | None = None  # the prefix cache's changes published as vLLM's KV events

    def __init__(self, num_threads: int | None = None, cores: tuple[int, ...] | None = None) -> None:
        self._num_threads = num_threads  # torch's intra-op threads for the step thread; None: torch's default
        self._compute_threads = ComputeThreads(cores) if cores else None  # None: the OS places them
        self._lock = threading.RLock()  # re-entered by generate_batch, which admits a whole batch before a step
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._aborts: list[tuple[Context, int]] = []
        self._step_count = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._computed_tokens = 0
        self._progress_at = time.monotonic()  # the loop's last sign of life: a step ended, or it woke
        self._idle = False  # waiting for work (not stalled, however long ago it last stepped)

    def start(self) -> None:
        if self._thread is None:
            self._stopping = False
            self._thread = threading.Thread(target=self._loop, name="llm-engine-step", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        """Stops the loop thread; requests still in flight end with finish_reason "abort"."""
        if self._thread is not None:
            self._stopping = True
            self._wakeup.set()
            self._thread.join()
            self._thread = None
        self._abort_all()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    def _discard_step(self, done_fills: list[Context]) -> None:
        """After a failed step no KV it was to write can be trusted: its blocks leave the prefix cache,
        every context holding one drops its KV (recomputed if ever used again), and the fills it found
        fully cached are aborted with the rest."""
        with self._lock:
            untrusted = self.block_manager.rollback()
            for ctx in self.scheduler.contexts.values():
                if untrusted.intersection(ctx.block_table):
                    self.block_manager.release(ctx)
            for fill in done_fills:
                self.registry.finish(fill, "abort")
            self._publish_kv_events()

    def _publish_kv_events(self) -> None:
        """What the prefix cache recorded since the last step (engines/builtin/block_manager.py), as one batch."""
        events = self.block_manager.events
        if self.kv_events is not None and events:
            self.kv_events.publish(events[:])
            events.clear()

    def _abort_all(self) -> None:
        with self._lock:
            for ctx in self.scheduler.running + self.scheduler.waiting:
                self.registry.finish(ctx, "abort")

    def _loop(self) -> None:
        if self._num_threads:
            torch.set_num_threads(self._num_threads)  # a setting of the calling thread's: this one computes
        while not self._stopping:
            if not self.has_work():
                self._idle = True
                self._wakeup.wait()
                self._wakeup.clear()
                self._progress_at = time.monotonic()
                self._idle = False
                continue
            try:
                if self._compute_threads:
                    self._compute_threads.pin()  # cheap when every thread is in place (see ComputeThreads)
                self.step()
            except Exception:  # a bug must not leave every waiter hanging silently
                log.exception("engine step failed; aborting all requests")
                self._abort_all()
            self._progress_at = time.monotonic()

    def step_loop_problem(self) -> str | None:
        """Why the step loop cannot serve (its thread is gone, or work waits and no step has ended for
        ``step_stall_timeout_s``); None when it serves."""
        if self._thread is None:
            return "the step loop is not running"
        if not self._thread.is_alive():
            return "the step loop's thread died"
        silent = time.monotonic() - self._progress_at > self.step_stall_timeout_s
        if silent and not self._idle and self.has_work():
            return f"no step has ended for over {self.step_stall_timeout_s:g}s while requests wait"
        return None

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborts)

    def step(self) -> None:
        batch, done_fills = self._schedule()
        try:
            result = self.runner.run(batch) if batch.entries else StepResult(None)
        except Exception:
            self._discard_step(done_fills)
            raise
        self._postprocess(batch, result, done_fills)

    def _schedule(self) -> tuple[ScheduledBatch, list[Context]]:
        with self._lock:
            self._apply_aborts()
            self._step_count += 1
            batch, done_fills = self.scheduler.schedule()
            now = time.perf_counter()
            for ctx, _ in batch.entries:
                if ctx.scheduled_at is None:
                    ctx.scheduled_at = now
                    if not ctx.is_fill:
                        self.metrics.queue_time.observe(now - ctx.arrived_at)
            return batch, done_fills

    def _postprocess(self, batch: ScheduledBatch, result: StepResult, done_fills: list[Context]) -> None:
        with self._lock:
            sampled = batch.sampled()
            for ctx, first, scores in result.scores:  # by position: a recomputed (preempted) chunk rewrites its own
                ctx.scores.update(zip(range(first, first + len(scores)), scores))
            self.block_manager.commit()
            self._publish_kv_events()
            for ctx, n in batch.entries:
                ctx.num_computed_tokens += n
                self.block_manager.free_outside_window(ctx)
                ctx.num_computed_by_request += n
                ctx.last_used = self._step_count
                if ctx.is_fill and ctx.num_pending_tokens == 0:
                    done_fills.append(ctx)
            self._computed_tokens += batch.num_tokens
            for fill in done_fills:
                self.registry.finish(fill, None)
            now = time.perf_counter()
            for i, ctx in enumerate(sampled):
                self._append_token(ctx, result.samples, i, now)

    def _append_token(self, ctx: Context, result: SampleResult, i: int, now: float) -> None:
        token = result.token_ids[i]
        ctx.token_ids.append(token)
        self._generation_tokens += 1
        metrics = self.metrics
        if ctx.num_generated_tokens == 1:
            metrics.ttft.observe(now - ctx.arrived_at)
        else:
            metrics.itl.observe(now - ctx.last_token_at)
        ctx.last_token_at = now
        params = ctx.params
        finish = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            finish = "stop"
        elif ctx.grammar is not None and ctx.grammar.finished:
            finish = "stop"
        elif ctx.num_generated_tokens >= params.max_tokens or len(ctx) >= self.max_model_len:
            finish = "length"
        event = TokenEvent(
            token,
            result.logprobs[i] if result.logprobs else None,
            result.top_logprobs[i] if result.top_logprobs else None,
            finish,
            self._step_count,
            # A preempted request computes its prompt again: it may have computed more than the prompt.
            max(0, ctx.num_prompt_tokens - ctx.num_computed_by_request) if ctx.num_generated_tokens == 1 else None,
        )
        deliver = ctx.deliver
        if finish:  # before delivering, so a caller woken by the last token sees the request gone
            metrics.e2e.observe(now - ctx.arrived_at)
            metrics.finished(finish).inc()
            self.registry.finish(ctx, finish, delivered=True)
        deliver(event)

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for ctx, arrival in aborts:
            if ctx.arrival == arrival and ctx.status is not Status.IDLE:
                self.registry.finish(ctx, "abort")

    def _wake_after_this_tick(self, loop: asyncio.AbstractEventLoop) -> None:
        """Wakes the step thread once ``loop`` has run the rest of its current iteration: requests submitted in one
        iteration (a gather of generations, an app's fan-out) reach the same step. Grammar-constrained ones come back
        from their matcher's thread in iterations of their own. A step thread already awake schedules what has
        arrived, as before. (Woken at the first of 16 forks, it had taken the GIL after Python's switch interval and
        stepped with 2 of them; the other 14 waited out that step.)"""
        loop.call_soon(self._wakeup.set)

    def _request_abort(self, ctx: Context, arrival: int) -> None:
        with self._lock:
            self._aborts.append((ctx, arrival))
        self._wakeup.set()


def resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Callable:
    """A callback for the engine thread that sets ``future``'s result on its own event loop."""
    def resolve(result) -> None:
        if not future.done():
            future.set_result(result)

    return lambda result: loop.call_soon_threadsafe(resolve, result)
