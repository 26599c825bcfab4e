"""A compiled engine (EngineConfig.compile) run in a process of its own, for the tests of the compiled
forward: once torch.compile's inductor is imported, Triton kernels run later through the interpreter
in the same process fail (their nested @triton.jit helpers no longer resolve), so the pytest process
never imports it.

    python tests/engines/builtin/compiled_engine_run.py < request.json

Request: {"model": DIR, "dtype": ..., "max_tokens": N, "batches": [[prompt, ...], ...]}, optionally
"quantization", "max_num_batched_tokens", "then_model" (another model, compiled in the same process after the first, given
the same batches) and "then_quantized" ({"quantization": ..., "batches": ...}: the first model again, quantized, compiled
last in the same process, which spares the suite a process that imports inductor). Prints JSON: the greedy tokens of each batch (run in turn), the graphs compiled
when the engine was ready and after the batches, how many times dynamo traced the forward by then (each attempt's
count: "compile_attempt_1" counts the traces it restarted), the classes of the runner's last_hidden and of the head, how many
steps took their tokens from the greedy head's screen,
whether the graph's attention is the C++-bodied operator, "then_outputs", the second model's tokens, and
what each call of the compiled graph saw on the step thread: the context's size (its variables) and
torch.compile's cache key tag, beside kernels.native.operators_cache_tag()."""

import contextvars
import json
import sys

import torch
from torch._dynamo.utils import compilation_time_metrics, counters

from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from engines.builtin.types import SamplingParams
from kernels import native


def main() -> None:
    request = json.load(sys.stdin)
    params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
    engine = _started(request["model"], request)
    try:
        graphs_at_start = counters["stats"]["unique_graphs"]
        traces = {name: len(times) for name, times in compilation_time_metrics.items() if name.startswith("compile_attempt_")}
        assert traces, "torch no longer names its metrics compile_attempt_N: count dynamo's traces another way"
        seen = _probe_graph_calls(engine.runner.last_hidden)
        screened = _count_screened_steps(engine.runner)
        outputs = [engine.generate_batch(prompts, params) for prompts in request["batches"]]
        result = {"outputs": outputs, "graphs_at_start": graphs_at_start, "traces_at_start": traces,
                  "graphs_after": counters["stats"]["unique_graphs"],
                  "last_hidden": type(engine.runner.last_hidden).__name__,
                  "head": type(engine.runner.model.lm_head).__name__, "screened_steps": len(screened),
                  "native_attention": engine.runner.last_hidden.native_attention,
                  "context_sizes": [size for size, _ in seen], "cache_key_tags": sorted({tag for _, tag in seen}),
                  "operators_cache_tag": native.operators_cache_tag()}
    finally:
        engine.shutdown()
    if request.get("then_model"):
        engine = _started(request["then_model"], request)
        try:
            result["then_outputs"] = [engine.generate_batch(prompts, params) for prompts in request["batches"]]
        finally:
            engine.shutdown()
    if request.get("then_quantized"):
        quantized = request["then_quantized"]
        engine = _started(request["model"], {"dtype": request["dtype"], **quantized})  # the default token budget, as the eager engine it is held to
        try:
            result["quantized"] = {"head": type(engine.runner.model.lm_head).__name__,
                                   "outputs": [engine.generate_batch(prompts, params) for prompts in quantized["batches"]]}
        finally:
            engine.shutdown()
    print(json.dumps(result))


def _count_screened_steps(runner) -> list[int]:
    """The rows of each step whose tokens the runner's greedy head (the head's int8 screen) gave."""
    answered, head = [], runner.greedy_head
    if head is not None:
        def counted(hidden, seqs):
            tokens = head(hidden, seqs)
            if tokens is not None:
                answered.append(len(tokens))
            return tokens

        runner.greedy_head = counted
    return answered


def _probe_graph_calls(forward) -> list[tuple[int, str]]:
    """(the context's size, the cache key tag) as each call of the forward's compiled graph finds them."""
    seen, graph = [], forward._decoder

    def probed(*args):
        seen.append((len(contextvars.copy_context()), torch.compiler.config.cache_key_tag))
        return graph(*args)

    forward._decoder = probed
    return seen


def _started(model: str, request: dict) -> EngineCore:
    budget = {"max_num_batched_tokens": request["max_num_batched_tokens"]} if "max_num_batched_tokens" in request else {}
    engine = EngineCore(EngineConfig(model=model, dtype=request["dtype"], quantization=request.get("quantization"),
                                     compile=True, **budget))
    engine.start()
    return engine


if __name__ == "__main__":
    main()
