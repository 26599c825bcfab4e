"""The C++ linear over a few rows (kernels/native/linear.cpp) and its torch op: equal to F.linear up to
summation order, and left for torch's path where it cannot take a weight."""

import pytest
import torch
import torch.nn.functional as F

from kernels import native, row_linear

needs_bf16_dot = pytest.mark.skipif(not row_linear.fits(torch.zeros(4, 32, dtype=torch.bfloat16)),
                                    reason="the kernels were built without a bf16 dot product (this CPU or compiler)")
DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16_dot)]


def _reference(x, weight, bias):
    """In fp64, rounded once to x's dtype: what a kernel summing in fp32 should be within a rounding of."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 6])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_fp64(dtype, rows, with_bias):
    torch.manual_seed(rows)
    weight, x = torch.randn(200, 96, dtype=dtype), torch.randn(rows, 96, dtype=dtype)
    bias = torch.randn(200, dtype=dtype) if with_bias else None
    assert row_linear.fits(weight)

    out = row_linear.row_linear(x, row_linear.pack(weight), bias)

    expected = _reference(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, 200)
    # fp32 sums in another order than fp64; bf16 rounds its fp32 sum once, as F.linear does.
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    assert ((out.double() - expected).abs() <= step * expected.abs() + 1e-4).all()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=step, atol=1e-4)


def test_weights_off_its_tiles_are_left_to_torch():
    kernels = native.library()
    assert kernels.supports_linear(torch.zeros(8, 64))
    assert not kernels.supports_linear(torch.zeros(8, 40)), "inputs not a multiple of 32"
    assert not kernels.supports_linear(torch.zeros(6, 64)), "outputs not a multiple of 4"
    assert not kernels.supports_linear(torch.zeros(8, 64, dtype=torch.float16))


def test_inputs_it_cannot_take_are_refused_not_read():
    weight = torch.randn(8, 32)
    packed = row_linear.pack(weight)
    for x, bias in ((torch.randn(1, 64), None), (torch.randn(32), None), (torch.randn(1, 32, dtype=torch.bfloat16), None),
                    (torch.randn(1, 32), torch.randn(4)), (torch.randn(1, 32), torch.randn(8, dtype=torch.float64))):
        with pytest.raises(ValueError, match="does not take"):
            row_linear.row_linear(x, packed, bias)
    with pytest.raises(ValueError, match="does not take"):  # a weight not packed for it
        row_linear.row_linear(torch.randn(1, 32), weight, None)


def test_compiled_graph_calls_the_op(monkeypatch):
    weight = torch.randn(64, 32)
    packed = row_linear.pack(weight)
    calls = []
    kernels = native.library()
    monkeypatch.setattr(kernels, "linear", lambda *args, run=kernels.linear: calls.append(args) or run(*args))

    @torch.compile(fullgraph=True, dynamic=False)
    def step(x):
        return torch.relu(row_linear.row_linear(x, packed, None)) + 1

    x = torch.randn(1, 32)
    torch.testing.assert_close(step(x), torch.relu(F.linear(x, weight)) + 1, rtol=2.0**-20, atol=1e-5)
    assert calls, "the compiled graph ran the kernel"
