"""bf16 on CPU: the engine's bf16 scores are as close to
HF's fp32 forward as HF's own bf16 forward is, and greedy generation follows HF's bf16 generate except
where HF's own top two logits are within bf16 rounding of each other (the documented tie tolerance)."""

from __future__ import annotations

import asyncio
import math

import pytest
import torch

from engines.builtin.cpu_linear import NativeLinear, cpu_has_fast_bf16
from engines.builtin.loader import resolve_dtype
from engines.builtin.types import SamplingParams
from tests.kernel_markers import needs_bf16
from tests.support.compiled import COMPILED_MAX_TOKENS

pytestmark = pytest.mark.timeout(180)

# A greedy pick may differ from HF's only where HF's top two logits are this close: two bf16 steps at
# their magnitude (0.25 for a logit of 16-32), and at least 0.0625 (two steps near 4-8).
TIE_STEPS, TIE_FLOOR = 2, 0.0625


def tie_tolerance(logit: float) -> float:
    return max(TIE_FLOOR, TIE_STEPS * 2.0 ** (math.floor(math.log2(abs(logit))) - 7))


def test_auto_dtype_follows_the_cpu():
    assert resolve_dtype("auto", "cpu") == ("bfloat16" if cpu_has_fast_bf16() else "float32")
    assert resolve_dtype("float32", "cpu") == "float32"


@pytest.fixture(scope="module")
def hf_bf16(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.bfloat16).eval()


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(5)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (9, 23, 40)]


@needs_bf16
def test_bf16_scores_are_as_accurate_as_hf_bf16(make_engine, hf_bf16, tiny_model_dir):
    """Measured against HF's fp32 forward. Not against HF's bf16 scores themselves: the engine's attention
    rounds along another path (the C++ kernel's tiles), as accurate as torch's SDPA against an fp64
    reference, and this random model's ±30 logits magnify any two bf16 paths' differences (its last
    prompt: both 2.1 from fp32 at worst, 0.2 from each other)."""
    from transformers import AutoModelForCausalLM

    hf_fp32 = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = make_engine(dtype="bfloat16")
    assert isinstance(engine.runner.model.lm_head, NativeLinear)
    for tokens in prompts():
        ours = torch.tensor([s.logprob for s in asyncio.run(engine.score(tokens))])
        ours_error, hf_error = (ours - _logprobs(hf_fp32, tokens)).abs(), (_logprobs(hf_bf16, tokens) - _logprobs(hf_fp32, tokens)).abs()
        assert ours_error.mean() <= 1.25 * hf_error.mean() + 0.01
        assert ours_error.max() <= 1.25 * hf_error.max() + 0.05


def _logprobs(model, tokens: list[int]) -> torch.Tensor:
    """Each prompt token's logprob after the ones before it, as ``model`` scores it."""
    with torch.inference_mode():
        logprobs = torch.log_softmax(model(torch.tensor([tokens])).logits[0, :-1].float(), -1)
    return logprobs.gather(1, torch.tensor(tokens[1:]).unsqueeze(1)).squeeze(1)


@needs_bf16
def test_bf16_greedy_follows_hf_bf16_up_to_ties(make_engine, hf_bf16):
    engine = make_engine(dtype="bfloat16")
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    assert_follows_hf_up_to_ties(hf_bf16, engine.generate_batch(prompts(), params), 16)


@needs_bf16
def test_compiled_bf16_follows_hf_bf16_up_to_ties(run_compiled, tiny_model_dir, hf_bf16):
    """The compiled forward (`compile`, run in a process of its own: test_compiled_model.py) holds to
    the same tolerance as the eager one."""
    compiled = run_compiled(tiny_model_dir, "bfloat16", [prompts()])
    assert compiled["head"] == "NativeLinear"  # the head runs eagerly, on the C++ kernel
    assert_follows_hf_up_to_ties(hf_bf16, compiled["outputs"][0], COMPILED_MAX_TOKENS)


def assert_follows_hf_up_to_ties(hf_bf16, outputs: list[list[int]], max_tokens: int) -> None:
    """Each greedy output of prompts() equals HF's bf16 generate, or leaves it where HF's own top two
    logits are within tie_tolerance of each other."""
    assert len(outputs) == len(prompts())
    for prompt, ours in zip(prompts(), outputs):
        with torch.inference_mode():
            theirs = hf_bf16.generate(torch.tensor([prompt]), max_new_tokens=max_tokens, min_new_tokens=max_tokens,
                                      do_sample=False)
            theirs = theirs[0, len(prompt):].tolist()
            if ours == theirs:
                continue
            first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            logits = hf_bf16(torch.tensor([prompt + theirs[:first]])).logits[0, -1].float()
        top = logits.topk(2).values
        assert top[0] - top[1] <= tie_tolerance(float(top[0])), f"diverged at {first} with HF's margin {top[0] - top[1]:.4f}"
