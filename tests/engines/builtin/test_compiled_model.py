"""`compile`: the forward compiled by torch.compile gives the eager forward's tokens (fp32: the
same tokens for a batch of chunked prefills and batched decodes of several lengths, and for a single
stream; bf16 in test_core_bf16.py), and is compiled before the engine serves. The compiled engine
runs in a process of its own (compiled_engine_run.py says why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engines.builtin.types import SamplingParams

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = 12
RUNNER = Path(__file__).with_name("compiled_engine_run.py")
ROOT = Path(__file__).parents[3]


def run_compiled(model_dir, dtype: str, batches: list[list[list[int]]]) -> dict:
    request = {"model": str(model_dir), "dtype": dtype, "max_tokens": MAX_TOKENS, "batches": batches}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(RUNNER)], input=json.dumps(request), capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def mixed_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (5, 31, 64, 17)]


def test_compiled_fp32_gives_the_eager_tokens_and_compiles_only_at_start(make_engine, tiny_model_dir):
    # A batch of four (chunked prefills of different lengths, then batched decodes), one alone, a batch of three.
    batches = [mixed_prompts(), mixed_prompts()[1:2], [[7, 8], [9, 10, 11], [12]]]
    compiled = run_compiled(tiny_model_dir, "float32", batches)
    assert compiled["forward"] == "CompiledForward"
    eager = make_engine()
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert compiled["outputs"] == [eager.generate_batch(prompts, params) for prompts in batches]
    assert compiled["graphs_at_start"] > 0
    assert compiled["graphs_after"] == compiled["graphs_at_start"]  # nothing compiled while serving


def test_compile_is_refused_where_it_does_not_run():
    from engines.builtin.config import EngineConfig

    with pytest.raises(ValueError, match="compile"):
        EngineConfig(compile=True, quantization="int8")
