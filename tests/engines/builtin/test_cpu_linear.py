"""The unquantized model's CPU linears (engines/builtin/cpu_linear.py): every call on the C++ kernel, at
any row count and leading shape, equal to F.linear up to summation order; weights it cannot take stay
torch's."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin.cpu_linear import NativeLinear, NativeMLP, prepare_cpu_linears
from engines.builtin.model import MLP
from kernels import native_linear
from tests.kernel_markers import needs_bf16

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)]


class _Tiny(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.embed = nn.Embedding(64, 96).to(dtype)
        self.proj = nn.Linear(96, 160, bias=True).to(dtype)
        self.odd = nn.Linear(96, 6).to(dtype)  # off the kernel's blocks
        self.lm_head = nn.Linear(96, 64, bias=False).to(dtype)
        self.lm_head.weight = self.embed.weight  # tied


@pytest.fixture
def kernel_calls(monkeypatch):
    """How many times the kernel's op ran (the op NativeLinear takes from native_linear.ops() when made)."""
    calls = []
    linear, gated = native_linear.ops()
    monkeypatch.setattr(native_linear, "ops", lambda: (lambda *args: calls.append(args) or linear(*args), gated))
    return calls


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1,), (7,), (300,), (2, 5)])
def test_every_call_runs_the_kernel_and_equals_f_linear(dtype, shape, kernel_calls):
    linear = nn.Linear(96, 160, bias=True).to(dtype)
    x = torch.randn(*shape, 96, dtype=dtype)

    out = NativeLinear(linear)(x)

    assert len(kernel_calls) == 1 and out.shape == (*shape, 160) and out.dtype == dtype
    # Another summation order than torch's, one rounding to bf16.
    torch.testing.assert_close(out, F.linear(x, linear.weight, linear.bias),
                               rtol=2.0**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_linears_the_kernel_takes_are_replaced(dtype, kernel_calls):
    model = _Tiny(dtype)
    x = torch.randn(3, 96, dtype=dtype)
    expected = {name: getattr(model, name)(x) for name in ("proj", "odd", "lm_head")}

    prepare_cpu_linears(model)

    assert isinstance(model.proj, NativeLinear) and isinstance(model.lm_head, NativeLinear)
    assert type(model.odd) is nn.Linear
    assert model.embed.weight.shape == (64, 96), "the tied embedding keeps its weight"
    for name, value in expected.items():
        torch.testing.assert_close(getattr(model, name)(x), value, rtol=2.0**-7 if dtype == torch.bfloat16 else 1e-5,
                                   atol=1e-4)
    assert len(kernel_calls) == 2  # proj and the head; odd ran on torch


@pytest.mark.parametrize("dtype", DTYPES)
def test_moves_with_the_module(dtype):
    linear = NativeLinear(nn.Linear(96, 64).to(dtype))
    # no copy of the weight beside the packed one, in fp32 either: every row count runs the kernel
    assert {name for name, _ in linear.named_buffers()} == {"packed", "bias"}
    assert not linear.state_dict(), "made from the checkpoint's weight at load, never saved"


@pytest.mark.parametrize("dtype", DTYPES)
def test_an_mlp_becomes_one_gated_call_and_one_linear(dtype):
    config = SimpleNamespace(hidden_size=96, intermediate_size=128)
    holder = nn.Module()
    holder.mlp = MLP(config).to(dtype)
    x = torch.randn(7, 96, dtype=dtype)
    expected = holder.mlp(x)

    prepare_cpu_linears(holder)

    assert isinstance(holder.mlp, NativeMLP)
    assert {name for name, _ in holder.mlp.gate_up_proj.named_buffers()} == {"packed"}
    torch.testing.assert_close(holder.mlp(x), expected, rtol=2.0**-6 if dtype == torch.bfloat16 else 1e-5, atol=1e-3)


def test_a_gelu_mlp_is_not_given_the_silu_gated_kernel():
    """The gated kernel applies SiLU: Gemma's GELU-tanh MLP must not become a NativeMLP."""
    config = SimpleNamespace(hidden_size=96, intermediate_size=128)
    holder = nn.Module()
    holder.mlp = MLP(config, "gelu_pytorch_tanh")
    x = torch.randn(7, 96)
    expected = holder.mlp(x)

    prepare_cpu_linears(holder)

    assert type(holder.mlp) is MLP
    torch.testing.assert_close(holder.mlp(x), expected, rtol=1e-5, atol=1e-4)
