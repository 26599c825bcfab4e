"""LLMEngine: contexts, fill/fork/generate, and the step loop on one background thread.

Threading: the step loop runs on its own thread. The public API may be called from an asyncio
loop on another thread; every change to scheduler or block state happens under ``_lock``, which
the loop holds while scheduling and post-processing but not while the model runs. Requests
only ever *mark* an in-flight sequence (abort); the loop applies the change between steps, so
the blocks of the batch being computed never change hands mid-step. Results reach asyncio
through ``loop.call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from pathlib import Path
from typing import AsyncIterator, Callable

import torch

from engines.seam import EngineStats
from engines.builtin.block_manager import BlockManager
from engines.builtin.config import EngineConfig
from engines.builtin.errors import ContextBusy, ContextNotFound, PromptTooLong
from engines.builtin.grammar import GrammarCompiler
from engines.builtin.loader import DTYPES, ModelSource, build_model, load_checkpoint, load_tokenizer
from engines.builtin.model_runner import ModelRunner, ScheduledBatch, StepResult, kv_block_bytes
from engines.builtin.quantization import quantize_linears
from engines.builtin.sampler import SampleResult
from engines.builtin.scheduler import Scheduler
from engines.builtin.sequence import Sequence, Status
from engines.builtin.types import FillResult, SamplingParams, TokenEvent, TokenScore

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        source = ModelSource(config.model)
        self.model_name = source.name
        self.tokenizer = load_tokenizer(source)
        hf_config, hf_state = load_checkpoint(source)
        num_blocks = config.num_blocks or config.kv_cache_memory // kv_block_bytes(hf_config, config.block_size, DTYPES[config.dtype])
        # One sequence must always fit in the cache on its own, or preemption could not help it.
        self.max_model_len = min(config.max_model_len or hf_config.max_position_embeddings, num_blocks * config.block_size)
        self.eos_token_ids = eos_token_ids(hf_config, self.tokenizer, source)
        self.grammars = GrammarCompiler(self.tokenizer, self.eos_token_ids)
        model = build_model(hf_config, hf_state, config.dtype, self.max_model_len)
        del hf_state
        if config.quantization:
            quantize_linears(model, config.quantization)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.seed, config.device)
        self.block_manager = BlockManager(
            num_blocks, config.block_size, self.runner.copy_rows, prefix_caching=config.enable_prefix_caching
        )
        self.scheduler = Scheduler(config, self.block_manager)
        self._lock = threading.Lock()
        self._wakeup = threading.Event()
        self._thread: threading.Thread | None = None
        self._stopping = False
        self._aborts: list[tuple[Sequence, int]] = []
        self._step_count = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._computed_tokens = 0

    # ---- step loop -------------------------------------------------------------------------

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

    def _discard_step(self, done_fills: list[Sequence]) -> None:
        """After a failed step no KV it was to write can be trusted: its blocks leave the prefix cache,
        every context holding one drops its KV (recomputed if ever used again), and the fills it found
        fully cached are aborted with the rest."""
        with self._lock:
            untrusted = self.block_manager.rollback()
            for seq in self.scheduler.contexts.values():
                if untrusted.intersection(seq.block_table):
                    self.block_manager.release(seq)
            for fill in done_fills:
                self._finish(fill, "abort")

    def _abort_all(self) -> None:
        with self._lock:
            for seq in self.scheduler.running + self.scheduler.waiting:
                self._finish(seq, "abort")

    def _loop(self) -> None:
        while not self._stopping:
            if not self.has_work():
                self._wakeup.wait()
                self._wakeup.clear()
                continue
            try:
                self.step()
            except Exception:  # a bug must not leave every waiter hanging silently
                log.exception("engine step failed; aborting all requests")
                self._abort_all()

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

    def _schedule(self) -> tuple[ScheduledBatch, list[Sequence]]:
        with self._lock:
            self._apply_aborts()
            self._step_count += 1
            return self.scheduler.schedule()

    def _postprocess(self, batch: ScheduledBatch, result: StepResult, done_fills: list[Sequence]) -> None:
        with self._lock:
            sampled = batch.sampled()
            for seq, first, scores in result.scores:  # by position: a recomputed (preempted) chunk rewrites its own
                seq.scores.update(zip(range(first, first + len(scores)), scores))
            self.block_manager.commit()
            for seq, n in batch.entries:
                seq.num_computed_tokens += n
                seq.num_computed_by_request += n
                seq.last_used = self._step_count
                if seq.is_fill and seq.num_pending_tokens == 0:
                    done_fills.append(seq)
            self._computed_tokens += batch.num_tokens
            for fill in done_fills:
                self._finish(fill, None)
            for i, seq in enumerate(sampled):
                self._append_token(seq, result.samples, i)

    def _append_token(self, seq: Sequence, result: SampleResult, i: int) -> None:
        token = result.token_ids[i]
        seq.token_ids.append(token)
        self._generation_tokens += 1
        params = seq.params
        finish = None
        if token in params.stop_token_ids or (not params.ignore_eos and token in self.eos_token_ids):
            finish = "stop"
        elif seq.grammar is not None and seq.grammar.finished:
            finish = "stop"
        elif seq.num_generated_tokens >= params.max_tokens or len(seq) >= self.max_model_len:
            finish = "length"
        event = TokenEvent(
            token,
            result.logprobs[i] if result.logprobs else None,
            result.top_logprobs[i] if result.top_logprobs else None,
            finish,
        )
        deliver = seq.deliver
        if finish:  # before delivering, so a caller woken by the last token sees the request gone
            self._finish(seq, finish, delivered=True)
        deliver(event)

    def _finish(self, seq: Sequence, reason: str | None, *, delivered: bool = False) -> None:
        """Ends ``seq``'s request: reason None completes a fill, else ends a generation."""
        deliver = seq.deliver
        if seq.is_fill and seq.score_top_k is not None:
            outcome = [seq.scores[p] for p in range(1, len(seq))] if reason is None else None
        elif seq.is_fill:
            cached = max(0, len(seq) - seq.num_computed_by_request)
            outcome = FillResult(seq.context_id, len(seq), cached) if reason is None else None
        else:
            outcome = None if delivered else TokenEvent(seq.token_ids[-1] if seq.token_ids else 0, finish_reason=reason)
        self.scheduler.remove(seq)
        seq.clear_request()
        if seq.temporary or self.scheduler.contexts.get(seq.context_id) is not seq:  # freed (maybe the id reused)
            self._drop(seq)
        if deliver is not None and (outcome is not None or reason == "abort"):
            deliver(outcome)

    def _drop(self, seq: Sequence) -> int:
        if self.scheduler.contexts.get(seq.context_id) is seq:
            del self.scheduler.contexts[seq.context_id]
        seq.num_released_blocks = self.block_manager.release(seq)
        return seq.num_released_blocks

    def _apply_aborts(self) -> None:
        aborts, self._aborts = self._aborts, []
        for seq, arrival in aborts:
            if seq.arrival == arrival and seq.status is not Status.IDLE:
                self._finish(seq, "abort")

    def _request_abort(self, seq: Sequence, arrival: int) -> None:
        with self._lock:
            self._aborts.append((seq, arrival))
        self._wakeup.set()

    # ---- contexts ----------------------------------------------------------------------------

    def _context(self, context_id: str) -> Sequence:
        try:
            return self.scheduler.contexts[context_id]
        except KeyError:
            raise ContextNotFound(context_id) from None

    def _new_context(self, context_id: str | None, parent_context_id: str | None, *, temporary: bool = False) -> Sequence:
        context_id = context_id or uuid.uuid4().hex
        if context_id in self.scheduler.contexts:
            raise ValueError(f"context {context_id!r} already exists")
        if parent_context_id is None:
            seq = Sequence(context_id, [], temporary=temporary)
        else:
            parent = self._context(parent_context_id)
            seq = Sequence(context_id, parent.token_ids, temporary=temporary)
            self.block_manager.fork(parent, seq)
        seq.last_used = self._step_count
        self.scheduler.contexts[context_id] = seq
        return seq

    def _check_length(self, seq: Sequence, extra: int) -> None:
        if len(seq) + extra > self.max_model_len:
            raise PromptTooLong(
                f"context {seq.context_id!r} would hold {len(seq) + extra} tokens, more than the maximum "
                f"context length of {self.max_model_len} tokens"
            )

    def fork(self, parent_context_id: str, context_id: str | None = None) -> str:
        with self._lock:
            return self._new_context(context_id, parent_context_id).context_id

    def ensure_context(self, context_id: str, tokens: list[int]) -> bool:
        """Creates ``context_id`` holding ``tokens`` unless it exists, its fill queued with nobody
        waiting for it. Returns whether it was created."""
        with self._lock:
            created = self._ensure_context(context_id, tokens)
        self._wakeup.set()
        return created

    def _ensure_context(self, context_id: str, tokens: list[int]) -> bool:
        if context_id in self.scheduler.contexts:
            return False
        self._check_prompt_length(tokens)
        seq = self._new_context(context_id, None)
        seq.token_ids += tokens
        self._prompt_tokens += len(tokens)
        self._submit(seq, None)
        return True

    def context_length(self, context_id: str) -> int | None:
        """Tokens the context holds; None when there is no such context."""
        with self._lock:
            seq = self.scheduler.contexts.get(context_id)
            return None if seq is None else len(seq)

    async def fill(self, tokens: list[int], *, context_id: str | None = None, parent_context_id: str | None = None) -> FillResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[FillResult] = loop.create_future()
        with self._lock:
            if context_id is not None and context_id in self.scheduler.contexts:
                if parent_context_id is not None:
                    raise ValueError(f"context {context_id!r} already exists; it cannot be forked from {parent_context_id!r}")
                seq = self._context(context_id)
                if seq.status is not Status.IDLE:
                    raise ContextBusy(f"context {context_id!r} is busy")
                self._check_length(seq, len(tokens))
            else:
                if parent_context_id is not None:
                    self._check_length(self._context(parent_context_id), len(tokens))
                else:
                    self._check_prompt_length(tokens)
                seq = self._new_context(context_id, parent_context_id)
            seq.token_ids += tokens
            self._prompt_tokens += len(tokens)
            arrival = self._submit(seq, _resolver(loop, future))
        return await self._outcome(seq, arrival, future, f"fill of context {seq.context_id!r} was aborted")

    async def score(self, tokens: list[int], top_logprobs: int = 0, *, priority: int = 0,
                    counted: bool = True) -> list[TokenScore]:
        """The logprob of each token after the ones before it (the first has none: ``len - 1`` scores),
        each with its ``top_logprobs`` most likely alternatives. Computed as a fill of a temporary
        context whose full blocks stay in the prefix cache, so generating from ``tokens`` next reuses them.
        ``counted``: whether they count as prompt tokens in stats (not when a generation from the same
        prompt follows, which counts them)."""
        self._check_prompt_length(tokens)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[TokenScore] | None] = loop.create_future()
        with self._lock:
            seq = self._new_context(None, None, temporary=True)
            seq.token_ids += tokens
            seq.score_top_k = top_logprobs
            seq.fill_priority = priority
            self._prompt_tokens += len(tokens) if counted else 0
            arrival = self._submit(seq, _resolver(loop, future))
        return await self._outcome(seq, arrival, future, "scoring the prompt was aborted")

    def _check_prompt_length(self, tokens: list[int]) -> None:
        if len(tokens) > self.max_model_len:
            raise PromptTooLong(
                f"{len(tokens)} prompt tokens is more than the maximum context length of {self.max_model_len} tokens")

    def _submit(self, seq: Sequence, deliver: Callable | None) -> int:
        """Queues ``seq``'s fill (under the lock); returns its arrival, which names the request for aborts."""
        seq.deliver = deliver
        self.scheduler.add(seq)
        return seq.arrival

    async def _outcome(self, seq: Sequence, arrival: int, future: asyncio.Future, aborted: str):
        """What a queued fill delivers; cancelling the wait aborts the fill."""
        self._wakeup.set()
        try:
            result = await future
        except asyncio.CancelledError:
            self._request_abort(seq, arrival)
            raise
        if result is None:
            raise RuntimeError(aborted)
        return result

    async def free_context(self, context_id: str) -> int:
        with self._lock:
            seq = self._context(context_id)
            if seq.status is Status.IDLE:
                return self._drop(seq)
            self.scheduler.contexts.pop(context_id)  # _finish drops it once the loop aborts it
            arrival = seq.arrival
            self._aborts.append((seq, arrival))
        self._wakeup.set()
        while True:  # the loop finishes the request between steps; then the blocks are gone
            with self._lock:
                if seq.status is Status.IDLE:
                    return seq.num_released_blocks
            await asyncio.sleep(0.001)

    # ---- generation --------------------------------------------------------------------------

    def generate(self, context_id: str, params: SamplingParams) -> AsyncIterator[TokenEvent]:
        return self._stream(params, context_id=context_id)

    def generate_from_prompt(
        self, prompt_tokens: list[int], params: SamplingParams, *, parent_context_id: str | None = None,
        parent_tokens: list[int] | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Generates after ``prompt_tokens``, or after the parent context's tokens plus them. With
        ``parent_tokens`` the parent is created from them if it does not exist, its fill queued with
        this generation (under one lock, so that a step takes both): the step that computes the
        parent's blocks shares them with its forks."""
        return self._stream(params, prompt_tokens=prompt_tokens, parent_context_id=parent_context_id,
                            parent_tokens=parent_tokens)

    async def _stream(self, params: SamplingParams, *, context_id=None, prompt_tokens=None, parent_context_id=None,
                      parent_tokens=None):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        # Compiling a grammar (the first one also builds llguidance's view of the vocabulary, ~0.5 s)
        # must not stall the server's event loop.
        grammar = await asyncio.to_thread(self._grammar_matcher, params) if params.grammar is not None else None
        seq, arrival = self._start_generation(
            params, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event), context_id, prompt_tokens,
            parent_context_id, grammar, parent_tokens=parent_tokens,
        )
        finished = False
        try:
            while True:
                event = await queue.get()
                finished = event.finish_reason is not None
                yield event
                if finished:
                    return
        finally:
            if not finished:
                self._request_abort(seq, arrival)

    def _grammar_matcher(self, params: SamplingParams):
        """Built outside the lock: a large grammar takes a while and the step loop needs the lock."""
        # generate_batch asks for every request; _stream only for constrained ones (no thread hop otherwise).
        return self.grammars.matcher(params.grammar) if params.grammar is not None else None

    def _start_generation(self, params, deliver, context_id, prompt_tokens, parent_context_id,
                          grammar, *, parent_tokens=None) -> tuple[Sequence, int]:
        with self._lock:
            if parent_tokens is not None and parent_context_id not in self.scheduler.contexts:
                if parent_context_id is None:
                    raise ValueError("parent_tokens need a parent_context_id to create")
                self._check_prompt_length(parent_tokens + prompt_tokens)  # nothing is created for a refusal
                self._ensure_context(parent_context_id, parent_tokens)
            if context_id is not None:
                seq = self._context(context_id)
                if seq.status is not Status.IDLE:
                    raise ContextBusy(f"context {context_id!r} is busy")
            else:
                if parent_context_id is not None:
                    self._check_length(self._context(parent_context_id), len(prompt_tokens))
                else:
                    self._check_prompt_length(prompt_tokens)
                seq = self._new_context(None, parent_context_id, temporary=True)
                seq.token_ids += prompt_tokens
                self._prompt_tokens += len(prompt_tokens)
            if not seq.token_ids:
                raise ValueError("cannot generate from an empty context")
            self._check_length(seq, 1)
            if seq.num_pending_tokens == 0:
                self.block_manager.uncompute_last_token(seq)
            seq.params = params
            seq.num_prompt_tokens = len(seq)
            seq.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            seq.grammar = grammar
            seq.deliver = deliver
            self.scheduler.add(seq)
            arrival = seq.arrival
        self._wakeup.set()
        return seq, arrival

    def generate_batch(self, prompts: list[list[int]], params: SamplingParams, *,
                       parent_context_id: str | None = None) -> list[list[int]]:
        """Synchronous one-shot generation for tests and benchmarks (each prompt after the parent
        context's tokens, if one is named); returns generated token ids.

        Steps on the calling thread when the loop thread is not started.
        """
        outputs: list[list[int]] = [[] for _ in prompts]
        done = [threading.Event() for _ in prompts]

        def collector(i: int) -> Callable:
            def deliver(event: TokenEvent | None) -> None:
                if event is not None:
                    outputs[i].append(event.token_id)
                if event is None or event.finish_reason is not None:
                    done[i].set()

            return deliver

        for i, prompt in enumerate(prompts):
            self._start_generation(params, collector(i), None, prompt, parent_context_id, self._grammar_matcher(params))
        if self._thread is None:
            while not all(event.is_set() for event in done):
                self.step()
        for event in done:
            event.wait()
        return outputs

    # ---- stats -------------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            blocks_total=self.block_manager.num_blocks,
            blocks_free=self.block_manager.num_free_blocks,
            cached_tokens=self.block_manager.num_cached_tokens,
            prefix_hit_tokens=self.block_manager.prefix_hit_tokens,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
        )

    @property
    def computed_tokens(self) -> int:
        """Tokens whose KV the model actually computed (prefill and decode), for hit-rate figures."""
        return self._computed_tokens


def _resolver(loop: asyncio.AbstractEventLoop, future: asyncio.Future) -> Callable:
    def resolve(result) -> None:
        if not future.done():
            future.set_result(result)

    return lambda result: loop.call_soon_threadsafe(resolve, result)


def eos_token_ids(hf_config, tokenizer, source: ModelSource) -> list[int]:
    ids: set[int] = set()
    for value in (getattr(hf_config, "eos_token_id", None), getattr(tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    if (Path(source.directory) / "generation_config.json").exists():
        from transformers import GenerationConfig

        value = GenerationConfig.from_pretrained(source.directory).eos_token_id
        ids.update([value] if isinstance(value, int) else value or [])
    return sorted(ids)
