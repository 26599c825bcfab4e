"""Quantized linears (int8 and int4 weight groups on the C++ kernels, and the torch kernels that serve where those do
not build) and engines running on them."""

from __future__ import annotations

import msgspec
import pytest
import torch
from torch import nn

from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from engines.builtin.quantization import (
    GROUP_SIZE,
    FbgemmInt8Linear,
    Int4Linear,
    Int8Linear,
    TorchInt4Linear,
    int4_groups,
    int8_groups,
    native_grouped,
    quantize_linears,
)
from engines.builtin.types import SamplingParams
from kernels import native
from tests.kernel_markers import needs_grouped


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return float((actual.float() - expected).norm() / expected.norm())


def random_linear(in_features=576, out_features=960, bias=False) -> nn.Linear:
    torch.manual_seed(0)
    linear = nn.Linear(in_features, out_features, bias=bias)
    nn.init.normal_(linear.weight, std=0.05)
    if bias:
        nn.init.normal_(linear.bias, std=0.5)
    return linear


# the C++ kernels, and torch's where those do not build
INT8_LINEARS = [pytest.param(Int8Linear, marks=needs_grouped), FbgemmInt8Linear]
INT4_LINEARS = [pytest.param(Int4Linear, marks=needs_grouped), TorchInt4Linear]


@pytest.mark.parametrize("int8", INT8_LINEARS)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_is_close_to_float(int8, rows, bias):
    linear = random_linear(bias=bias)
    x = torch.randn(rows, 576)
    out = int8(linear)(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 960)
    assert relative_error(out, linear(x).detach()) < 0.02


@pytest.mark.parametrize("int4", INT4_LINEARS)
@pytest.mark.parametrize("rows", [1, 3, 16])
@pytest.mark.parametrize("bias", [False, True])
def test_int4_linear_is_close_to_float(int4, rows, bias):
    linear = random_linear(bias=bias)
    x = torch.randn(rows, 576)
    out = int4(linear)(x)
    assert out.dtype == torch.float32 and out.shape == (rows, 960)
    assert relative_error(out, linear(x).detach()) < 0.12  # 16 levels per group of gaussian weights


@pytest.mark.parametrize("int4, tolerance", [pytest.param(Int4Linear, 1e-6, marks=needs_grouped), (TorchInt4Linear, 0.01)])
def test_int4_keeps_weights_that_already_are_4_bit_groups(int4, tolerance):
    """GGUF Q4_1 weights (scale * code + min per group of 32) come back out of the int4 layout: exactly on the
    C++ kernel (fp16 scales and minimums; rows that are whole int8 steps already), up to bf16 rounding of the
    output on torch's."""
    torch.manual_seed(0)
    out_features, in_features = 64, 128
    groups = (out_features, in_features // GROUP_SIZE, 1)
    scale = torch.rand(groups).add(0.5).bfloat16().float() / 64  # exact in bf16 and fp16, as both kernels keep them
    low = -8 * scale
    codes = torch.randint(0, 16, (out_features, in_features // GROUP_SIZE, GROUP_SIZE))
    codes[..., 0], codes[..., 1] = 0, 15  # every group spans its whole range
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = (codes * scale + low).view(out_features, in_features)
    x = torch.randint(-127, 128, (4, in_features)).float()
    x[:, ::GROUP_SIZE] = 127  # each group's int8 step is 1
    assert relative_error(int4(linear)(x), linear(x).detach()) < tolerance


@needs_grouped
def test_int8_keeps_weights_that_already_are_8_bit_groups():
    """GGUF Q8_0 weights (scale * code per group of 32) come back out of the int8 layout exactly (fp16 scales; rows
    that are whole int8 steps already)."""
    torch.manual_seed(0)
    out_features, in_features = 64, 128
    scale = torch.rand(out_features, in_features // GROUP_SIZE, 1).add(0.5).half().float() / 64
    codes = torch.randint(-127, 128, (out_features, in_features // GROUP_SIZE, GROUP_SIZE))
    codes[..., 0] = 127  # every group's largest code
    linear = nn.Linear(in_features, out_features, bias=False)
    linear.weight.data = (codes * scale).view(out_features, in_features)
    x = torch.randint(-127, 128, (4, in_features)).float()
    x[:, ::GROUP_SIZE] = 127  # each group's int8 step is 1
    assert relative_error(Int8Linear(linear)(x), linear(x).detach()) < 1e-6


@needs_grouped
def test_int8_kernel_is_exact_at_its_extremes():
    """Every code ±127 against every input ±127 (each pair of products 2 x 127 x 127, the most vpmaddubsw holds without
    saturating, and rows whose signs the kernel moves onto the codes): exact."""
    torch.manual_seed(0)
    signs = lambda *shape: torch.randint(0, 2, shape).float() * 2 - 1
    linear = nn.Linear(64, 32, bias=False)
    linear.weight.data = signs(32, 64) * 127 / 64  # scale 1/64: exact in fp16
    for x in (signs(3, 64) * 127, torch.full((1, 64), 127.0), torch.full((1, 64), -127.0)):
        assert torch.equal(Int8Linear(linear)(x), linear(x).detach())


@needs_grouped
def test_8_bit_codes_exclude_minus_128():
    """The kernel moves its rows' signs onto the codes (vpsignb), and -128 has no positive."""
    with pytest.raises(ValueError, match="-127 to 127"):
        native.library().pack_q8(torch.full((32, 32), -128, dtype=torch.int8), torch.ones(32, 1))


def int8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as the group-quantized kernels read it: each group of 32 inputs in int8 steps of its largest |x| / 127 (the
    reciprocal taken in fp32 and multiplied, as the kernel does, so ties round alike)."""
    groups = x.view(x.shape[0], -1, GROUP_SIZE)
    largest = groups.abs().amax(-1, keepdim=True)
    inverse = torch.where(largest > 0, torch.full_like(largest, 127.0).div(largest), 0.0)
    return ((groups * inverse).round().double() * largest.div(127).double()).view(x.shape)


def dequantized_int4(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The 4-bit kernel's weight (code * scale + minimum, fp16 scales and minimums) and minimums, float64."""
    codes, scale, low = int4_groups(linear.weight)
    scale, low = scale.half().double(), low.half().double()
    return (codes.view(*scale.shape, GROUP_SIZE).double() * scale[..., None] + low[..., None]).flatten(1), low


def dequantized_int8(linear: nn.Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8-bit kernel's weight (code * scale, fp16 scales), and no minimums."""
    codes, scale = int8_groups(linear.weight)
    scale = scale.half().double()
    return (codes.view(*scale.shape, GROUP_SIZE).double() * scale[..., None]).flatten(1), torch.zeros_like(scale)


@needs_grouped
@pytest.mark.parametrize("quantized, dequantized", [(Int4Linear, dequantized_int4), (Int8Linear, dequantized_int8)])
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 16, 100, 1000])
def test_grouped_kernel_multiplies_its_dequantized_weights(quantized, dequantized, rows):
    """Every row count the kernel's passes split differently (passes of up to 6 rows on AVX2, 12 on AVX-512; 1,000
    rows quantized by the team's threads), a bias, a group of zeros and an odd count of blocks: the products of int8
    rows and the weights as the kernel stores them, each group's minimum (4-bit) taking the group's exact sum of
    inputs."""
    linear = random_linear(in_features=160, out_features=96, bias=True)
    weight, low = dequantized(linear)
    x = torch.randn(rows, 160)
    x[0, :32] = 0
    rows_ = int8_rows(x)
    group_sums = lambda values: values.double().view(rows, 5, 32).sum(-1)
    expected = rows_ @ weight.T + linear.bias.double() + (group_sums(x) - group_sums(rows_)) @ low.T
    out = quantized(linear)(x)
    assert (out.double() - expected).abs().max() < 1e-5 * expected.abs().max()


def test_quantize_linears_replaces_every_linear_and_rejects_unknown_schemes():
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Sequential(nn.Linear(64, 32)))
    quantize_linears(model, "int8")
    int8, int4 = (Int8Linear, Int4Linear) if native_grouped() else (FbgemmInt8Linear, TorchInt4Linear)
    assert [type(m) for m in model.modules() if isinstance(m, (nn.Linear, int8))] == [int8] * 2
    head = nn.Sequential()
    head.body, head.lm_head = nn.Linear(64, 64), nn.Linear(64, 32)
    quantize_linears(head, "int4")
    assert isinstance(head.body, int4) and isinstance(head.lm_head, int8)  # the head keeps 8 bits
    with pytest.raises(ValueError, match="unknown quantization"):
        quantize_linears(nn.Sequential(nn.Linear(64, 64)), "int3")


def test_linears_the_grouped_kernels_do_not_take_go_to_torchs(monkeypatch):
    """Sizes that are not whole groups of inputs or blocks of features (a vocabulary of 32,001), and machines where the
    C++ kernels are not available, keep fbgemm's int8 and torch's int4 kernels: which torch.compile cannot trace for
    int8, so an engine asked to compile such a model says so."""
    from engines.builtin import quantization

    odd_head = nn.Linear(64, 33, bias=False)
    assert isinstance(quantization.int8_linear(odd_head), FbgemmInt8Linear)
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 33))
    quantize_linears(model, "int8")
    assert quantization.untraceable_linears(model) == ([] if native_grouped() else ["0"]) + ["1"]
    monkeypatch.setattr(quantization, "native_grouped", lambda: False)
    assert isinstance(quantization.int8_linear(nn.Linear(64, 64)), FbgemmInt8Linear)
    assert isinstance(quantization.int4_linear(nn.Linear(64, 64)), TorchInt4Linear)
    int4_model = nn.Sequential(nn.Linear(64, 64))
    quantize_linears(int4_model, "int4")
    assert quantization.untraceable_linears(int4_model) == []  # torch's int4 kernel traces


@pytest.mark.model
def test_an_engine_refuses_to_compile_fbgemms_linears(monkeypatch):
    from engines.builtin import quantization

    monkeypatch.setattr(quantization, "native_grouped", lambda: False)
    with pytest.raises(ValueError, match="compile cannot trace int8"):
        EngineCore(EngineConfig(quantization="int8", compile=True))


def test_quantization_is_a_cpu_option():
    with pytest.raises(msgspec.ValidationError, match="CPU only"):
        msgspec.convert({"quantization": "int8", "device": "cuda"}, EngineConfig)
    with pytest.raises(msgspec.ValidationError):
        msgspec.convert({"quantization": "fp8"}, EngineConfig)


@pytest.mark.model
@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_smollm2_still_answers(scheme):
    """Questions both modes answer, as fp32 does. (Capital questions sit on a knife edge for a 135M model's quantized
    forms: with fbgemm's int8, whose activations are 7-bit per tensor, int8 failed Germany's and int4, whose head it
    was, France's; so they are asked only where the C++ kernels serve. The accuracy benchmark is the measure of what
    the modes cost.)"""
    engine = EngineCore(EngineConfig(quantization=scheme))
    questions = {"Name three primary colors.": ["red", "blue", "yellow"]}
    if native_grouped():  # the capitals are not asked of torch's and fbgemm's kernels
        questions |= {"What is the capital of France?": ["paris"], "What is the capital of Germany?": ["berlin"]}
    for question, words in questions.items():
        prompt = engine.tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                      add_generation_prompt=True, tokenize=True)
        prompt = prompt["input_ids"] if not isinstance(prompt, list) else prompt
        [output] = engine.generate_batch([prompt], SamplingParams(max_tokens=24, temperature=0.0))
        answer = engine.tokenizer.decode(output).lower()
        assert all(word in answer for word in words), (question, answer)
    stats = engine.stats()
    assert stats.blocks_free == stats.blocks_total
