"""A compiled engine (EngineConfig.compile) run in a process of its own, for the tests of the compiled
forward: once torch.compile's inductor is imported, Triton kernels run later through the interpreter
in the same process fail (their nested @triton.jit helpers no longer resolve), so the pytest process
never imports it.

    python tests/engines/builtin/compiled_engine_run.py < request.json

Request: {"model": DIR, "dtype": ..., "max_tokens": N, "batches": [[prompt, ...], ...]}. Prints JSON:
the greedy tokens of each batch (run in turn), the graphs compiled when the engine was ready and after
the batches, and the classes of the runner's forward and of the head."""

import json
import sys

from torch._dynamo.utils import counters

from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from engines.builtin.types import SamplingParams


def main() -> None:
    request = json.load(sys.stdin)
    engine = EngineCore(EngineConfig(model=request["model"], dtype=request["dtype"], compile=True))
    engine.start()
    try:
        graphs_at_start = counters["stats"]["unique_graphs"]
        params = SamplingParams(max_tokens=request["max_tokens"], temperature=0.0, ignore_eos=True)
        outputs = [engine.generate_batch(prompts, params) for prompts in request["batches"]]
        result = {"outputs": outputs, "graphs_at_start": graphs_at_start,
                  "graphs_after": counters["stats"]["unique_graphs"],
                  "forward": type(engine.runner.forward).__name__, "head": type(engine.runner.model.lm_head).__name__}
    finally:
        engine.shutdown()
    print(json.dumps(result))


if __name__ == "__main__":
    main()
