"""Quantized linears (int8 fbgemm GEMM, int4 weight-only groups) and engines running on them."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from engines.builtin.quantization import (
    INT4_GROUP_SIZE,
    Int4Linear,
    Int8Linear,
    TorchInt4Linear,
    int4_groups,
    native_int4,
    quantize_linears,
)
from engines.builtin.types import SamplingParams
from tests.kernel_markers import needs_q4


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected).norm() / expected.norm())


def random_linear(in_features=576, out_features=960, bias=False) -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(linear.weight, std=0.05)
    if bias:
        nn.init.normal_(linear.bias, std=0.5)
    return linear


@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_close_to_float(rows, bias):
    linear = random_linear(bias=bias)
    x = torch.randn(rows, 576)
    assert relative_error(Int8Linear(linear)(x), linear(x).detach()) < 0.02


# the C++ kernel, and torch's where that does not build
INT4_LINEARS = [pytest.param(Int4Linear, marks=needs_q4), TorchInt4Linear]


@pytest.mark.parametrize("int4", INT4_LINEARS)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_is_close_to_float(int4, rows, bias):
    linear = random_linear(bias=bias)
    x = torch.randn(rows, 576)
    out = int4(linear)(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 960)
    assert relative_error(out, linear(x).detach()) < 0.12  # 16 levels per group of gaussian weights


@pytest.mark.parametrize("int4, tolerance", [pytest.param(Int4Linear, 1e-6, marks=needs_q4), (TorchInt4Linear, 0.01)])
def test_int4_keeps_weights_that_already_are_4_bit_groups(int4, tolerance):
    """GGUF Q4_1 weights (scale * code + min per group of 32) come back out of the int4 layout: exactly on the
    C++ kernel (fp16 scales and minimums; rows that are whole int8 steps already), up to bf16 rounding of the
    output on torch's."""
    torch.manual_seed(0)
    out_features, in_features = 64, 128
    groups = (out_features, in_features // INT4_GROUP_SIZE, 1)
    scale = torch.rand(groups).add(0.5).bfloat16().float() / 64  # exact in bf16 and fp16, as both kernels keep them
    low = -8 * scale
    codes = torch.randint(0, 16, (out_features, in_features // INT4_GROUP_SIZE, INT4_GROUP_SIZE))
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans its whole range
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = (codes * scale + low).view(out_features, in_features)
    x = torch.randint(-127, 128, (4, in_features)).float()
    x[:, ::INT4_GROUP_SIZE] = 127  # each group's int8 step is 1
    assert relative_error(int4(linear)(x), linear(x).detach()) < tolerance


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the 4-bit kernel reads it: each group of 32 inputs in int8 steps of its largest |x| / 127 (the
    reciprocal taken in fp32 and multiplied, as the kernel does, so ties round alike)."""
    groups = x.view(x.shape[0], -1, INT4_GROUP_SIZE)
    largest = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.full_like(largest, 127.0).div(largest), 0.0)
    return ((groups * inverse).round().double() * largest.div(127).double()).view(x.shape)


@needs_q4
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 16, 100, 1000])
def test_int4_kernel_multiplies_its_dequantized_weights(rows):
    """Every row count the kernel's passes split differently (passes of up to 6 rows on AVX2, 12 on AVX-512; 1,000
    rows quantized by the team's threads), a bias, a group of zeros and an odd count of blocks: the products of int8 rows and the weights code * scale +
    minimum (fp16 scales and minimums), each group's minimum taking the group's exact sum of inputs."""
    linear = random_linear(in_features=160, out_features=96, bias=True)
    codes, scale, low = int4_groups(linear.weight)
    scale, low = scale.half().double(), low.half().double()
    weight = (codes.view(96, 5, 32).double() * scale[..., None] + low[..., None]).view(96, 160)
    x = torch.randn(rows, 160)
    x[0, :32] = 0
    quantized = int8_rows(x)
    group_sums = lambda rows_: rows_.double().view(rows, 5, 32).sum(-1)
    expected = quantized @ weight.T + linear.bias.double() + (group_sums(x) - group_sums(quantized)) @ low.T
    out = Int4Linear(linear)(x)
    assert (out.double() - expected).abs().max() < 1e-5 * expected.abs().max()


def test_quantize_linears_replaces_every_linear_and_rejects_unknown_schemes():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32)))
    quantize_linears(model, "int8")
    assert [type(m).__name__ for m in model.modules() if isinstance(m, (nn.Linear, Int8Linear))] == ["Int8Linear"] * 2
    head = nn.Sequential()
    head.body, head.lm_head = nn.Linear(64, 64), nn.Linear(64, 32)
    quantize_linears(head, "int4")
    int4 = Int4Linear if native_int4() else TorchInt4Linear
    assert isinstance(head.body, int4) and isinstance(head.lm_head, Int8Linear)  # the head keeps 8 bits
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(nn.Sequential(nn.Linear(64, 64)), "int3")


def test_quantization_is_a_cpu_option():
    with pytest.raises(msgspec.ValidationError, match="CPU only"):
        msgspec.convert({"quantization": "int8", "device": "cuda"}, EngineConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"quantization": "fp8"}, EngineConfig)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_smollm2_still_answers(scheme):
    """A question both modes answer, as fp32 does. (Capital questions sit on a knife edge for a 135M model's
    quantized forms: int8 answers "Paris" for France but not "Berlin" for Germany, int4 the other way round, its
    first token for France flipping from "The" to "L'" with the int8 rounding of its rows, and llama.cpp's server
    on the same Q4_1 weights also begins "L'Étoile". The accuracy benchmark is the measure of what they cost.)"""
    engine = EngineCore(EngineConfig(quantization=scheme))
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "Name three primary colors."}], add_generation_prompt=True, tokenize=True
    )
    prompt = prompt["input_ids"] if not isinstance(prompt, list) else prompt
    [output] = engine.generate_batch([prompt], SamplingParams(max_tokens=16, temperature=0.0))
    answer = engine.tokenizer.decode(output).lower()
    assert "red" in answer and "blue" in answer and "yellow" in answer
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total
