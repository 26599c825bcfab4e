"""`compile`: the forward compiled by torch.compile gives the eager forward's tokens (fp32: the
same tokens for a batch of chunked prefills and batched decodes of several lengths, and for a single
stream; bf16 in test_core_bf16.py; int4 and int8 up to their rows' int8 rounding ties), and is compiled before the engine serves. The compiled engine
runs in a process of its own (compiled_engine_run.py says why)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from engines.builtin import quantization
from engines.builtin.types import SamplingParams
from kernels import native
from tests.support.compiled import COMPILED_MAX_TOKENS

pytestmark = pytest.mark.timeout(600)

MAX_TOKENS = COMPILED_MAX_TOKENS
BUDGET = 24  # tokens a step computes: the 64-token prompt is three chunks


def mixed_prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(11)
    return [torch.randint(3, 49152, (n,), generator=generator).tolist() for n in (5, 31, 64, 17)]


def fp32_batches() -> list[list[list[int]]]:
    # A prompt alone whose first chunks want no logits (steps that sample no row: that their rows tensor was
    # made otherwise than a sampling step's once recompiled the graphs while serving), a batch of four
    # (chunked prefills of different lengths, then batched decodes), one alone, a batch of three.
    return [mixed_prompts()[2:3], mixed_prompts(), mixed_prompts()[1:2], [[7, 8], [9, 10, 11], [12]]]


def quantized_batches() -> list[list[list[int]]]:
    return [mixed_prompts(), mixed_prompts()[2:3]]


# int4, the default model's own scheme. int8's linears are GroupedLinear too, which the graph calls the same way
# (linear_q8 for linear_q4), and eager int8 is held to fp32 in test_core_quantization: a second compile (~30 s of
# the suite) is left out.
QUANTIZED_SCHEME = "int4"


@pytest.fixture(scope="module")
def compiled_fp32(run_compiled, tiny_model_dir, smollm2_tokenizer_dir, tmp_path_factory) -> dict:
    """One compiling process for this module (a compile is most of a minute here, and each process imports
    inductor): the tiny model's batches, then another model's (other weights, same architecture), then the tiny
    model quantized, each compiled after the one before in the same process."""
    other_dir = other_tiny_model(smollm2_tokenizer_dir, tmp_path_factory.mktemp("other-tiny-llama"))
    compiled = run_compiled(tiny_model_dir, "float32", fp32_batches(), max_num_batched_tokens=BUDGET,
                            then_model=str(other_dir),
                            then_quantized={"quantization": QUANTIZED_SCHEME, "batches": quantized_batches()})
    return compiled | {"other_dir": other_dir}


def test_compiled_fp32_gives_the_eager_tokens_and_compiles_only_at_start(compiled_fp32, make_engine):
    batches, compiled = fp32_batches(), compiled_fp32
    assert compiled["last_hidden"] == "CompiledForward"
    assert compiled["screened_steps"] > 0, "greedy steps of few rows take the head's screen over the graph's hidden states"
    assert compiled["native_attention"], "the graph calls the C++ attention operator where the kernels build"
    eager = make_engine(max_num_batched_tokens=BUDGET)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    assert compiled["outputs"] == [eager.generate_batch(prompts, params) for prompts in batches]
    # dynamo specialises sizes 0 and 1: a graph for several tokens (a prompt's lone row goes there too) and one for
    # batch-1 decodes
    assert compiled["graphs_at_start"] == 2
    assert compiled["graphs_after"] == compiled["graphs_at_start"]  # nothing compiled while serving
    # each graph traced once: floats the modules hold (the embedding's norm_type, the norms' eps) traced as symbols made dynamo trace
    # every graph twice, half of a start's ~130 s
    assert compiled["traces_at_start"] == {"compile_attempt_0": compiled["graphs_at_start"]}
    # each step's graph is keyed by the schemas of Parrot's operators, and entering those settings leaves no new
    # context variable behind once the step thread has them (a patch made per call left two a step)
    assert [tag.endswith(compiled["operators_cache_tag"]) for tag in compiled["cache_key_tags"]] == [True]
    assert len(compiled["context_sizes"]) > 10 and len(set(compiled["context_sizes"][1:])) == 1


# How much less likely (nats) the eager int4 or int8 engine may find the compiled graph's pick than its own where the two
# part. Their rows are rounded to int8 inside each linear (as llama.cpp computes Q4_1 and Q8_0), so the last-bit differences
# between any two paths to the same hidden state (the graph's fused norms, or the eager engine's own prefill and
# decode attention) can move a row across a rounding step, and this random model's ±30 logits magnify that: the eager
# engine's greedy pick at one step and its own scoring of that step disagreed by 0.19 nats. A graph that computed
# anything else would part from the eager tokens by whole nats.
TIE_NATS = 0.5


def test_compiled_quantized_model_follows_the_eager_tokens_up_to_rounding_ties(compiled_fp32, make_engine):
    batches, compiled, scheme = quantized_batches(), compiled_fp32["quantized"], QUANTIZED_SCHEME
    assert compiled["head"] == ("Int8Linear" if quantization.native_grouped() else "FbgemmInt8Linear")  # runs eagerly
    eager = make_engine(quantization=scheme)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    for prompts, outputs in zip(batches, compiled["outputs"], strict=True):
        for prompt, ours, theirs in zip(prompts, outputs, eager.generate_batch(prompts, params), strict=True):
            if ours == theirs:
                continue
            first = next(i for i, (a, b) in enumerate(zip(ours, theirs)) if a != b)
            prefix = prompt + theirs[:first]
            eager_pick, compiled_pick = (asyncio.run(eager.score(prefix + [token]))[-1].logprob
                                         for token in (theirs[first], ours[first]))
            assert eager_pick - compiled_pick <= TIE_NATS, f"parted at {first}: {eager_pick:.3f} vs {compiled_pick:.3f}"


def test_a_second_compiled_model_runs_its_own_weights(compiled_fp32, make_engine):
    """Each graph has its model's weights frozen in, and the guards inside the model are dropped: the
    forward's own number is what keeps one model's graph from running for another in the same process."""
    compiled = compiled_fp32
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    other = make_engine(model=str(compiled["other_dir"]), max_num_batched_tokens=BUDGET)
    assert compiled["then_outputs"] == [other.generate_batch(prompts, params) for prompts in fp32_batches()]
    assert compiled["outputs"] != compiled["then_outputs"], "the two models must answer differently for this to show"


def other_tiny_model(tokenizer_dir, directory):
    """The tiny model's architecture and tokenizer with other random weights (conftest.tiny_model_dir's seed is 0)."""
    import shutil

    from transformers import LlamaForCausalLM

    from tests.support.models import tiny_llama_config

    torch.manual_seed(1)
    LlamaForCausalLM(tiny_llama_config()).save_pretrained(directory)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, directory)
    return directory


def test_compile_is_refused_where_it_does_not_run():
    from engines.builtin.config import EngineConfig

    with pytest.raises(ValueError, match="compile"):
        EngineConfig(compile=True, device="cuda")


def test_the_operators_cache_tag_follows_an_operators_schema():
    """Inductor's on-disk cache keys a graph by its code, not by the schemas of the custom operators it calls: it
    served a graph that called parrot_native::gated_linear with an argument the operator had lost. The compiled
    forward keys its graphs by this tag (the first test checks that each step's graph saw it), which changes with
    any of Parrot's operators' schemas, an operator's arguments as well as its name."""
    tags = [native.operators_cache_tag()]
    for schema in ("tag_probe(Tensor x) -> Tensor", "tag_probe(Tensor x, Tensor? y) -> Tensor"):
        probe = torch.library.Library("parrot", "FRAGMENT")
        probe.define(schema)
        try:
            tags.append(native.operators_cache_tag())
        finally:
            probe._destroy()
    assert len(set(tags)) == 3
    assert native.operators_cache_tag() == tags[0]
