"""`compile`: the forward compiled by torch.compile gives the eager forward's tokens (fp32: the
same tokens for prefills, batched decodes of several lengths and a single stream; bf16 in
test_core_bf16.py), and is compiled before the engine serves."""

from __future__ import annotations

import pytest
import torch

from engines.builtin.compiled_model import CompiledForward
from engines.builtin.types import SamplingParams

pytestmark = pytest.mark.timeout(600)

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


def mixed_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (5, 31, 64, 17)]


def test_compiled_fp32_gives_the_eager_tokens(make_engine):
    compiled = make_engine(compile=True)
    assert isinstance(compiled.runner.forward, CompiledForward)
    eager = make_engine()
    # A batch of four (chunked prefills of different lengths, then batched decodes), then one alone.
    assert compiled.generate_batch(mixed_prompts(), GREEDY) == eager.generate_batch(mixed_prompts(), GREEDY)
    assert compiled.generate_batch(mixed_prompts()[1:2], GREEDY) == eager.generate_batch(mixed_prompts()[1:2], GREEDY)


def test_compiling_happens_before_the_engine_serves(make_engine):
    from torch._dynamo.utils import counters

    engine = make_engine(compile=True)
    compiled_at_start = counters["stats"]["unique_graphs"]
    engine.generate_batch([[7, 8, 9, 10]], GREEDY)  # a prefill, then batch-1 decodes
    engine.generate_batch([[7, 8], [9, 10, 11], [12]], GREEDY)  # a batch of three
    assert counters["stats"]["unique_graphs"] == compiled_at_start  # nothing compiled while serving


def test_compile_is_refused_where_it_does_not_run():
    from engines.builtin.config import EngineConfig

    with pytest.raises(ValueError, match="compile"):
        EngineConfig(compile=True, quantization="int8")
