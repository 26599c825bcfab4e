"""The unquantized model's CPU linears (engines/builtin/cpu_linear.py): one-row calls on the C++ row
kernel, every other call as F.linear computes it."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin.cpu_linear import PackedLinear, RowLinear, cpu_has_fast_bf16, prepare_cpu_linears
from kernels import row_linear

needs_bf16 = pytest.mark.skipif(not cpu_has_fast_bf16() or not row_linear.fits(torch.zeros(4, 32, dtype=torch.bfloat16)),
                                reason="this CPU (or the kernels' compiler) has no bf16 dot product")


class _Tiny(nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.proj = nn.Linear(96, 160, bias=True).to(dtype)
        self.lm_head = nn.Linear(96, 64, bias=False).to(dtype)


@pytest.fixture
def row_calls(monkeypatch):
    """How many times the row kernel's op ran."""
    calls = []
    original = row_linear.row_linear
    monkeypatch.setattr(row_linear, "row_linear", lambda *args: calls.append(args) or original(*args))
    return calls


@pytest.mark.parametrize("module", [RowLinear, pytest.param(PackedLinear, marks=needs_bf16)])
@pytest.mark.parametrize("rows", [1, 7, 300])
def test_linear_equals_f_linear(module, rows, row_calls):
    dtype = torch.float32 if module is RowLinear else torch.bfloat16
    linear = nn.Linear(96, 160, bias=True).to(dtype)
    x = torch.randn(rows, 96, dtype=dtype)

    out = module(linear)(x)

    expected = F.linear(x, linear.weight, linear.bias)
    if rows == 1:  # the row kernel: another summation order, one rounding
        assert len(row_calls) == 1
        torch.testing.assert_close(out, expected, rtol=2.0**-7 if dtype == torch.bfloat16 else 1e-5, atol=1e-4)
    else:
        assert not row_calls and torch.equal(out, expected)


def test_fp32_model_gets_row_linears_sharing_its_weights():
    model = _Tiny(torch.float32)
    weight = model.proj.weight
    prepare_cpu_linears(model, compiled=False)
    assert isinstance(model.proj, RowLinear) and isinstance(model.lm_head, RowLinear)
    assert model.proj.weight is weight and model.proj.row_weight is not None


@needs_bf16
@pytest.mark.parametrize("compiled", [False, True])
def test_bf16_model_is_packed_where_not_compiled(compiled):
    """Compiled, freezing packs the decoder's linears; the head runs eagerly, so it is packed either way."""
    model = _Tiny(torch.bfloat16)
    prepare_cpu_linears(model, compiled=compiled)
    assert isinstance(model.lm_head, PackedLinear)
    assert isinstance(model.proj, RowLinear if compiled else PackedLinear)


def test_weights_the_kernel_cannot_take_stay_on_torch(row_calls):
    linear = RowLinear(nn.Linear(40, 6))  # off the kernel's tiles
    x = torch.randn(1, 40)
    assert linear.row_weight is None
    assert torch.equal(linear(x), F.linear(x, linear.weight, linear.bias)) and not row_calls
