"""EngineCore: the builtin engine's compute, loaded from a checkpoint, with its request API: contexts
(fill, fork, free), generation (after a context, or from a prompt) and scoring. Requests are queued for
the step loop (step_loop.py) and their results awaited through asyncio futures and queues.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import AsyncIterator, Callable, TypeVar

import torch

from engines.seam import EngineStats
from engines.builtin.block_manager import BlockManager
from engines.builtin.config import EngineConfig, served_model_name
from engines.builtin.context import Context, Status
from engines.builtin.context_registry import ContextRegistry
from engines.builtin.errors import ContextBusy
from engines.builtin.grammar import GrammarCompiler
from engines.builtin.kv_event_publisher import KVEventPublisher
from engines.builtin.loader import DTYPES, ModelSource, build_model, load_checkpoint, load_tokenizer, resolve_dtype
from engines.builtin.kv_capacity import longest_sequence, planned_blocks
from engines.builtin.model import architecture_of
from engines.builtin.model_runner import ModelRunner
from engines.builtin.cpu_linear import prepare_cpu_linears
from engines.builtin.prometheus_metrics import EngineMetrics
from engines.builtin.quantization import UntraceableError, quantize_linears, untraceable_linears
from engines.builtin.scheduler import BACKGROUND_PRIORITY, Scheduler
from engines.builtin.step_loop import StepLoop, resolver
from engines.builtin.types import SamplingParams, TokenEvent, TokenScore
from engines.seam.contexts import FillResult
from kernels import native

T = TypeVar("T")
log = logging.getLogger(__name__)


class EngineCore(StepLoop):
    def __init__(self, config: EngineConfig):
        self.config = config
        if config.num_threads:  # for steps taken on this thread (step() without the loop thread: tests, benchmarks)
            torch.set_num_threads(config.num_threads)
        torch.manual_seed(config.seed)
        source = ModelSource(config.model)
        self.model_name = source.name
        self.tokenizer = load_tokenizer(source)
        hf_config = on_a_passing_thread(lambda: self._load(source), config.num_threads, config.compute_cores)
        self.eos_token_ids = eos_token_ids(hf_config, self.tokenizer, source)
        self.grammars = GrammarCompiler(self.tokenizer, self.eos_token_ids)
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, self.runner.copy_rows, prefix_caching=config.enable_prefix_caching,
            window=self.runner.model.architecture.freeing_window,
        )
        if config.kv_events_endpoint:
            self.block_manager.events = []
            self.kv_events = KVEventPublisher(config.kv_events_endpoint, replay_endpoint=config.kv_events_replay_endpoint,
                                              topic=config.kv_events_topic)
        self.scheduler = Scheduler(config, self.block_manager)
        self.registry = ContextRegistry(self.scheduler, self.block_manager, self.max_model_len)
        self.metrics = EngineMetrics(served_model_name(config), self.stats)
        self.step_stall_timeout_s = config.step_stall_timeout_s
        super().__init__(config.num_threads, config.compute_cores)
        if self.runner.compiled:
            on_a_passing_thread(self._compile, config.num_threads, config.compute_cores)

    def _compile(self) -> None:
        """Runs both graphs of the compiled forward before the engine serves: several tokens (two prompts'
        prefill and decodes; a lone prompt's prefill goes there too), then a batch-1 decode."""
        params = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
        self.generate_batch([[1, 2, 3], [4, 5, 6]], params)
        self.generate_batch([[1, 2, 3]], params)

    def _load(self, source: ModelSource):
        """The model built and its KV cache allocated (on a passing thread, see on_a_passing_thread); returns
        the checkpoint's config."""
        config = self.config
        hf_config, hf_state = load_checkpoint(source)
        self.dtype = resolve_dtype(config.dtype, config.device)
        # The weights are in memory (the model takes hf_state's tensors): a budget by fraction sees what is left.
        num_blocks = planned_blocks(config, hf_config, DTYPES[self.dtype])
        self.max_model_len = longest_sequence(config, hf_config, num_blocks, architecture_of(hf_config).freeing_window)
        model = build_model(hf_config, hf_state, self.dtype, self.max_model_len)
        del hf_state
        compile = config.compile and native.has_compiler()
        if config.compile and not compile:
            log.warning("--compile: no C++ compiler found ($CXX, c++, g++, clang++), which torch.compile needs on "
                        "CPU; running eagerly")
        if config.quantization:
            quantize_linears(model, config.quantization)
            untraceable = untraceable_linears(model.model) if compile else []  # the head runs eagerly
            if untraceable:
                raise UntraceableError(f"compile cannot trace {config.quantization} here: {len(untraceable)} linears "
                                       f"(first {untraceable[0]}) on fbgemm's kernel, as the C++ group-quantized "
                                       "kernels are not available or do not take their sizes")
        elif config.device == "cpu":
            prepare_cpu_linears(model)
        self.runner = ModelRunner(model, num_blocks, config.block_size, config.seed, config.device,
                                  compile=compile)
        return hf_config

    def fork(self, parent_context_id: str, context_id: str | None = None) -> str:
        with self._lock:
            return self.registry.new(context_id, parent_context_id, step=self._step_count).context_id

    def ensure_context(self, context_id: str, tokens: list[int]) -> bool:
        """Creates ``context_id`` holding ``tokens`` unless it exists, its fill queued with nobody
        waiting for it: in the background, last in line. Returns whether it was created."""
        with self._lock:
            created = self._ensure_context(context_id, tokens, background=True)
        self._wakeup.set()
        return created

    def _ensure_context(self, context_id: str, tokens: list[int], *, background: bool = False) -> bool:
        if context_id in self.scheduler.contexts:
            return False
        self.registry.check_prompt_length(tokens)
        ctx = self.registry.new(context_id, None, step=self._step_count)
        ctx.token_ids += tokens
        if background:
            ctx.background, ctx.fill_priority = True, BACKGROUND_PRIORITY
        self._prompt_tokens += len(tokens)
        self._submit(ctx, None)
        return True

    def _needed(self, context_id: str, priority: int) -> None:
        """A request forks ``context_id``: a background fill of it is on that request's way now, at its
        priority (the fork matches its blocks as they are computed)."""
        ctx = self.scheduler.contexts[context_id]
        if ctx.background:
            ctx.background, ctx.fill_priority = False, priority

    def context_length(self, context_id: str) -> int | None:
        """Tokens the context holds; None when there is no such context."""
        with self._lock:
            ctx = self.scheduler.contexts.get(context_id)
            return None if ctx is None else len(ctx)

    async def fill(self, tokens: list[int], *, context_id: str | None = None, parent_context_id: str | None = None,
                   priority: int = 0) -> FillResult:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[FillResult] = loop.create_future()
        with self._lock:
            if context_id is not None and context_id in self.scheduler.contexts:
                if parent_context_id is not None:
                    raise ValueError(f"context {context_id!r} already exists; it cannot be forked from {parent_context_id!r}")
                ctx = self.registry.get(context_id)
                if ctx.status is not Status.IDLE:
                    raise ContextBusy(f"context {context_id!r} is busy")
                self.registry.check_length(ctx, len(tokens))
            else:
                if parent_context_id is not None:
                    self.registry.check_length(self.registry.get(parent_context_id), len(tokens))
                    self._needed(parent_context_id, priority)
                else:
                    self.registry.check_prompt_length(tokens)
                ctx = self.registry.new(context_id, parent_context_id, step=self._step_count)
            ctx.token_ids += tokens
            ctx.fill_priority = priority
            self._prompt_tokens += len(tokens)
            arrival = self._submit(ctx, resolver(loop, future))
        return await self._outcome(ctx, arrival, future, f"fill of context {ctx.context_id!r} was aborted")

    async def score(self, tokens: list[int], top_logprobs: int = 0, *, priority: int = 0,
                    counted: bool = True) -> list[TokenScore]:
        """The logprob of each token after the ones before it (the first has none: ``len - 1`` scores),
        each with its ``top_logprobs`` most likely alternatives. Computed as a fill of a temporary
        context whose full blocks stay in the prefix cache, so generating from ``tokens`` next reuses them.
        ``counted``: whether they count as prompt tokens in stats (not when a generation from the same
        prompt follows, which counts them)."""
        self.registry.check_prompt_length(tokens)
        loop = asyncio.get_running_loop()
        future: asyncio.Future[list[TokenScore] | None] = loop.create_future()
        with self._lock:
            ctx = self.registry.new(None, None, temporary=True, step=self._step_count)
            ctx.token_ids += tokens
            ctx.score_top_k = top_logprobs
            ctx.fill_priority = priority
            self._prompt_tokens += len(tokens) if counted else 0
            arrival = self._submit(ctx, resolver(loop, future))
        return await self._outcome(ctx, arrival, future, "scoring the prompt was aborted")

    def _submit(self, ctx: Context, deliver: Callable | None) -> int:
        """Queues ``ctx``'s fill (under the lock); returns its arrival, which names the request for aborts."""
        ctx.deliver = deliver
        self.scheduler.add(ctx)
        return ctx.arrival

    async def _outcome(self, ctx: Context, arrival: int, future: asyncio.Future, aborted: str):
        """What a queued fill delivers; cancelling the wait aborts the fill."""
        self._wake_after_this_tick(asyncio.get_running_loop())
        try:
            result = await future
        except asyncio.CancelledError:
            self._request_abort(ctx, arrival)
            raise
        if result is None:
            raise RuntimeError(aborted)
        return result

    def trim_context(self, context_id: str, tokens: list[int]) -> int:
        """Keeps the longest common prefix of the context's tokens and ``tokens`` (their KV too); returns its length."""
        with self._lock:
            ctx = self.registry.get(context_id)
            if ctx.status is not Status.IDLE:
                raise ContextBusy(f"context {context_id!r} is busy")
            common = next((i for i, (a, b) in enumerate(zip(ctx.token_ids, tokens)) if a != b),
                          min(len(ctx), len(tokens)))
            if common < len(ctx):
                self.registry.truncate(ctx, common)
            return common

    def holds_prefix(self, context_id: str, tokens: list[int]) -> int | None:
        """Tokens the context holds when they are the first of ``tokens`` (-1 when they are not); None when there is
        no such context."""
        with self._lock:
            ctx = self.scheduler.contexts.get(context_id)
            if ctx is None:
                return None
            return len(ctx) if ctx.token_ids == tokens[:len(ctx)] else -1

    async def free_context(self, context_id: str) -> int:
        released: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        with self._lock:
            ctx = self.registry.get(context_id)
            if ctx.status is Status.IDLE:
                return self.registry.drop(ctx)
            self.scheduler.contexts.pop(context_id)  # finish() drops it once the loop aborts it
            ctx.on_released = resolver(asyncio.get_running_loop(), released)
            arrival = ctx.arrival
            self._aborts.append((ctx, arrival))
        self._wakeup.set()
        return await released  # the loop ends the request between steps, then drops the context

    def generate(self, context_id: str, params: SamplingParams) -> AsyncIterator[TokenEvent]:
        return self._stream(params, context_id=context_id)

    def generate_from_prompt(
        self, prompt_tokens: list[int], params: SamplingParams, *, parent_context_id: str | None = None,
        parent_tokens: list[int] | None = None, keep_as: str | None = None,
    ) -> AsyncIterator[TokenEvent]:
        """Generates after ``prompt_tokens``, or after the parent context's tokens plus them. With
        ``parent_tokens`` the parent is created from them if it does not exist, its fill queued with
        this generation (under one lock, so that a step takes both): the step that computes the
        parent's blocks shares them with its forks. ``keep_as``: the generation's context is kept under that
        id once it finishes (stop or length), holding its prompt and output; else it is freed."""
        return self._stream(params, prompt_tokens=prompt_tokens, parent_context_id=parent_context_id,
                            parent_tokens=parent_tokens, keep_as=keep_as)

    async def _stream(self, params: SamplingParams, *, context_id=None, prompt_tokens=None, parent_context_id=None,
                      parent_tokens=None, keep_as=None):
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[TokenEvent] = asyncio.Queue()
        # Compiling a grammar (the first one also builds llguidance's view of the vocabulary, which takes longer)
        # must not stall the server's event loop.
        grammar = await asyncio.to_thread(self._grammar_matcher, params) if params.grammar is not None else None
        ctx, arrival = self._start_generation(
            params, lambda event: loop.call_soon_threadsafe(queue.put_nowait, event), context_id, prompt_tokens,
            parent_context_id, grammar, parent_tokens=parent_tokens, keep_as=keep_as,
        )
        self._wake_after_this_tick(loop)
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
                self._request_abort(ctx, arrival)

    def _grammar_matcher(self, params: SamplingParams):
        """Built outside the lock: a large grammar takes a while and the step loop needs the lock."""
        # generate_batch asks for every request; _stream only for constrained ones (no thread hop otherwise).
        return self.grammars.matcher(params.grammar) if params.grammar is not None else None

    def _start_generation(self, params, deliver, context_id, prompt_tokens, parent_context_id,
                          grammar, *, parent_tokens=None, keep_as=None) -> tuple[Context, int]:
        with self._lock:
            if parent_tokens is not None and parent_context_id not in self.scheduler.contexts:
                if parent_context_id is None:
                    raise ValueError("parent_tokens need a parent_context_id to create")
                self.registry.check_prompt_length(parent_tokens + prompt_tokens)  # nothing is created for a refusal
                self._ensure_context(parent_context_id, parent_tokens)
            if context_id is not None:
                ctx = self.registry.get(context_id)
                if ctx.status is not Status.IDLE:
                    raise ContextBusy(f"context {context_id!r} is busy")
            else:
                if parent_context_id is not None:
                    self.registry.check_length(self.registry.get(parent_context_id), len(prompt_tokens))
                    self._needed(parent_context_id, params.priority)
                else:
                    self.registry.check_prompt_length(prompt_tokens)
                ctx = self.registry.new(keep_as, parent_context_id, temporary=True, step=self._step_count)
                ctx.kept_when_finished = keep_as is not None
                ctx.token_ids += prompt_tokens
                self._prompt_tokens += len(prompt_tokens)
            if not ctx.token_ids:
                raise ValueError("cannot generate from an empty context")
            self.registry.check_length(ctx, 1)
            if ctx.num_pending_tokens == 0:
                self.block_manager.uncompute_last_token(ctx)
            ctx.params = params
            ctx.num_prompt_tokens = len(ctx)
            ctx.generator = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
            ctx.grammar = grammar
            ctx.deliver = deliver
            self.scheduler.add(ctx)
            return ctx, ctx.arrival

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

        # All prompts admitted before the loop thread schedules any: one at a time, a step could start between two
        # and split the batch by timing (the prompts' chunks, and with them the attention's summation order, then
        # varied). The grammar matchers are built first, outside the lock (see _grammar_matcher).
        matchers = [self._grammar_matcher(params) for _ in prompts]
        try:
            with self._lock:
                for i, (prompt, matcher) in enumerate(zip(prompts, matchers)):
                    self._start_generation(params, collector(i), None, prompt, parent_context_id, matcher)
        finally:  # those admitted before a refusal are served too
            self._wakeup.set()
        if self._thread is None:
            while not all(event.is_set() for event in done):
                self.step()
        for event in done:
            event.wait()
        return outputs

    def stats(self) -> EngineStats:
        return EngineStats(
            running=len(self.scheduler.running),
            waiting=len(self.scheduler.waiting),
            blocks_total=self.block_manager.num_blocks,
            blocks_free=self.block_manager.num_free_blocks,
            block_size=self.block_manager.block_size,
            cached_tokens=self.block_manager.num_cached_tokens,
            prefix_hit_tokens=self.block_manager.prefix_hit_tokens,
            prompt_tokens=self._prompt_tokens,
            generation_tokens=self._generation_tokens,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            latency_preemptions=self.scheduler.latency_preemptions,
        )

    @property
    def computed_tokens(self) -> int:
        """Tokens whose KV the model actually computed (prefill and decode), for hit-rate figures."""
        return self._computed_tokens


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


def on_a_passing_thread(work: Callable[[], T], num_threads: int | None = None,
                        cores: tuple[int, ...] | None = None) -> T:
    """``work()`` on a thread of its own, joined. The engine computes on its step thread alone: torch's
    OpenMP workers belong to the thread that first ran a parallel op and live as long as it, and a second
    thread's workers beside an idle first set made every op of the second markedly slower (docs/engine.md,
    "Measurements behind design choices"). Loading on a thread that then ends leaves the step thread's
    workers the only ones. ``num_threads``: torch's intra-op threads there (a per-thread setting; None:
    torch's default). ``cores``: the cores it computes on (the engine's compute cores: the thread that
    starts it may be kept off them)."""

    def run() -> T:
        if num_threads:
            torch.set_num_threads(num_threads)
        if cores:
            os.sched_setaffinity(0, cores)
        return work()

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine-load") as pool:
        return pool.submit(run).result()
