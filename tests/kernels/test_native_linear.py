"""The C++ linear (kernels/native/linear.cpp) and its torch op: equal to F.linear up to summation order
at every row count the kernel splits differently, and refused where it cannot take a weight."""

import pytest
import torch
import torch.nn.functional as F

from kernels import native, native_linear
from tests.kernel_markers import needs_bf16

DTYPES = [torch.float32, pytest.param(torch.bfloat16, marks=needs_bf16)]


def _reference(x, weight, bias):
    """In fp64, rounded once to x's dtype: what a kernel summing in fp32 should be within a rounding of."""
    return F.linear(x.double(), weight.double(), None if bias is None else bias.double())


# 1-6: unrolled steps; 7-12 one pass; 13, 16: passes of equal rows; 0: nothing to do; from 17 (17, 25, 40) the
# passes read their rows interleaved (native/linear.cpp's interleave: whole vectors of steps, then the rest).
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 6, 7, 12, 13, 16, 17, 25, 40])
@pytest.mark.parametrize("with_bias", [False, True])
def test_linear_matches_fp64(dtype, rows, with_bias):
    torch.manual_seed(rows)
    # 90 inputs: 45 bf16 pairs, an odd step count that leaves the unrolled loop a remainder.
    weight, x = torch.randn(224, 90, dtype=dtype), torch.randn(rows, 90, dtype=dtype)
    bias = torch.randn(224, dtype=dtype) if with_bias else None
    assert native_linear.fits(weight)

    out = native_linear.native_linear(x, native_linear.pack(weight), bias)

    expected = _reference(x, weight, bias)
    assert out.dtype == dtype and out.shape == (rows, 224)
    # fp32 sums in another order than fp64; bf16 rounds its fp32 sum once, as F.linear does.
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    assert ((out.double() - expected).abs() <= step * expected.abs() + 1e-4).all()
    torch.testing.assert_close(out, F.linear(x, weight, bias), rtol=step, atol=1e-4)


# Threads take each other's work when theirs is done (native/linear.cpp's Band): whichever thread computes a
# block of outputs, each is computed once, the same way. 3 blocks of outputs, so 5 threads leave some bands
# empty; 300 rows in bf16 on AMX tiles are a chunk of 256, one of 32 and 12 left, in tiles configured for
# each (test_tiled_rows_match_fp64_and_the_vector_path covers the tiles alone).
@pytest.mark.parametrize("dtype", DTYPES)
def test_every_thread_count_gives_the_same_outputs(dtype):
    torch.manual_seed(0)
    weight, gate_up = torch.randn(96, 64, dtype=dtype), torch.randn(192, 64, dtype=dtype)
    x = torch.randn(300, 64, dtype=dtype)
    packed, packed_gated = native_linear.pack(weight), native_linear.pack_gated(gate_up)
    threads, outputs = torch.get_num_threads(), []
    try:
        for count in (1, 2, 3, 5):
            torch.set_num_threads(count)
            outputs.append((native_linear.native_linear(x, packed, None), native_linear.native_gated_linear(x, packed_gated)))
    finally:
        torch.set_num_threads(threads)
    for plain, gated in outputs[1:]:
        assert torch.equal(plain, outputs[0][0]) and torch.equal(gated, outputs[0][1])
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    torch.testing.assert_close(outputs[0][0], F.linear(x, weight), rtol=step, atol=1e-4)
    gate, up = F.linear(x.float(), gate_up.float()).chunk(2, dim=-1)
    torch.testing.assert_close(outputs[0][1].float(), F.silu(gate) * up, rtol=4 * step, atol=1e-2)


# From 17 rows a prefill's rows are interleaved for the vector passes (native/linear.cpp's interleaved_rows, on
# AVX-512): the same multiply-adds in the same order as rows read in place, so 24 rows (two interleaved passes of
# 12) equal two calls of 12 (each one pass read in place) bit for bit, plain and gated.
def test_interleaved_rows_sum_as_rows_read_in_place():
    torch.manual_seed(2)
    x, weight, gate_up = torch.randn(24, 96), torch.randn(64, 96), torch.randn(2 * 64, 96)
    packed, packed_gated = native_linear.pack(weight), native_linear.pack_gated(gate_up)
    halves = lambda op, w: torch.cat([op(x[:12].contiguous(), w), op(x[12:].contiguous(), w)])  # noqa: E731

    plain = native_linear.native_linear(x, packed, None)
    assert torch.equal(plain, halves(lambda rows, w: native_linear.native_linear(rows, w, None), packed))
    assert torch.equal(native_linear.native_gated_linear(x, packed_gated), halves(native_linear.native_gated_linear, packed_gated))
    torch.testing.assert_close(plain, F.linear(x, weight), rtol=2.0**-20, atol=1e-4)


# Past ~512 KB of input the vector path takes the rows in equal chunks (native/linear.cpp's kVectorChunkBytes):
# 1,001 fp32 rows of 576 features are 5 chunks of 200-201 rows, each in passes of its own; every row is computed
# (a row no chunk covers would keep whatever its output memory held).
def test_many_rows_go_in_chunks_that_cover_every_row():
    torch.manual_seed(1)
    x, weight, gate_up = torch.randn(1001, 576), 0.05 * torch.randn(96, 576), 0.05 * torch.randn(2 * 64, 576)
    plain = native_linear.native_linear(x, native_linear.pack(weight), None)
    gated = native_linear.native_gated_linear(x, native_linear.pack_gated(gate_up))
    torch.testing.assert_close(plain, F.linear(x, weight), rtol=2.0**-20, atol=1e-4)
    gate, up = F.linear(x, gate_up).chunk(2, dim=-1)
    torch.testing.assert_close(gated, F.silu(gate) * up, rtol=2.0**-19, atol=1e-4)
    for rows in (0, 1, 227, 228):  # nothing; one row; a chunk's worth; just past it (two of 114)
        out = native_linear.native_linear(x[:rows], native_linear.pack(weight), None)
        torch.testing.assert_close(out, F.linear(x[:rows], weight), rtol=2.0**-20, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_input_features_give_the_bias(dtype):
    weight, bias = torch.zeros(64, 0, dtype=dtype), torch.randn(64, dtype=dtype)
    out = native_linear.native_linear(torch.zeros(300, 0, dtype=dtype), native_linear.pack(weight), bias)
    assert torch.equal(out, bias.expand(300, 64))


def test_weights_off_its_blocks_are_left_to_torch():
    kernels = native.library()
    assert kernels.supports_linear(torch.zeros(64, 33)), "fp32 takes any input count"
    assert not kernels.supports_linear(torch.zeros(48, 64)), "outputs not a multiple of 32"
    assert not kernels.supports_linear(torch.zeros(64, 64, dtype=torch.float16))
    if native_linear.fits(torch.zeros(32, 2, dtype=torch.bfloat16)):
        assert not kernels.supports_linear(torch.zeros(64, 33, dtype=torch.bfloat16)), "bf16 inputs in pairs"


def test_inputs_it_cannot_take_are_refused_not_read():
    weight = torch.randn(32, 32)
    packed = native_linear.pack(weight)
    for x, bias in ((torch.randn(1, 64), None), (torch.randn(32), None), (torch.randn(1, 32, dtype=torch.bfloat16), None),
                    (torch.randn(1, 32), torch.randn(4)), (torch.randn(1, 32), torch.randn(32, dtype=torch.float64))):
        with pytest.raises(ValueError, match="does not take"):
            native_linear.native_linear(x, packed, bias)
    with pytest.raises(ValueError, match="does not take"):  # a weight not packed for it
        native_linear.native_linear(torch.randn(1, 32), weight, None)


@pytest.mark.slow  # torch.compile
def test_compiled_graph_calls_the_op(monkeypatch):
    weight = torch.randn(64, 32)
    packed = native_linear.pack(weight)
    calls = []
    kernels = native.library()
    monkeypatch.setattr(kernels, "linear", lambda *args, run=kernels.linear: calls.append(args) or run(*args))

    @torch.compile(fullgraph=True, dynamic=True)
    def step(x):
        return torch.relu(native_linear.native_linear(x, packed, None)) + 1

    for rows in (1, 5, 40):
        x = torch.randn(rows, 32)
        torch.testing.assert_close(step(x), torch.relu(F.linear(x, weight)) + 1, rtol=2.0**-20, atol=1e-5)
    assert len(calls) == 3, "the compiled graph ran the kernel at every row count"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 5, 12, 25])
def test_gated_linear_is_silu_of_gate_times_up(dtype, rows):
    """silu(x @ gate.T) * (x @ up.T) from one [2I, K] weight, rounded where torch's unfused ops round (gate, up,
    silu(gate), product): equal to them but for summation order and exp's last bits. Gates reach far past exp's
    fp32 range (x 40): silu there is 0 or the gate itself, never NaN."""
    torch.manual_seed(rows)
    weight, x = torch.randn(2 * 96, 90, dtype=dtype), torch.randn(rows, 90, dtype=dtype)
    weight[:8] *= 40
    assert native_linear.fits_gated(weight)

    out = native_linear.native_gated_linear(x, native_linear.pack_gated(weight))

    gate, up = F.linear(x, weight).chunk(2, dim=-1)
    assert out.dtype == dtype and out.shape == (rows, 96) and not out.isnan().any()
    step = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-20
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=2 * step, atol=1e-3)


def test_gated_weights_off_its_blocks_are_left_alone():
    assert native_linear.fits_gated(torch.zeros(128, 32))
    assert not native_linear.fits_gated(torch.zeros(96, 32)), "gate and up each a whole number of blocks"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gated_linear_takes_a_strided_input(dtype):
    weight, x = torch.randn(2 * 64, 96, dtype=dtype), torch.randn(96, 9, dtype=dtype).t()  # rows not contiguous
    out = native_linear.native_gated_linear(x, native_linear.pack_gated(weight))
    expected = native_linear.native_gated_linear(x.contiguous(), native_linear.pack_gated(weight))
    assert torch.equal(out, expected)


def test_a_cpu_with_tiles_uses_them(amx_tiles):
    assert amx_tiles.use_tiles(True), "AMX on this CPU, but the kernels were not given the tile state"


# bf16 inputs in whole tile steps (96: three of 32) go through AMX tiles: rows in passes of 32 (two tiles of 16),
# the rest in tiles configured to their count (1, 15, 17, 31), passes in chunks of 128 rows (160).
# On a CPU without tiles both calls take the vector path: the fp64 and F.linear checks are what hold there.
@needs_bf16
@pytest.mark.parametrize("rows", [1, 15, 16, 17, 31, 32, 33, 64, 100, 160])
def test_tiled_rows_match_fp64_and_the_vector_path(rows, tiles_restored):
    torch.manual_seed(rows)
    weight, x, bias = torch.randn(224, 96, dtype=torch.bfloat16), torch.randn(rows, 96, dtype=torch.bfloat16), torch.randn(224, dtype=torch.bfloat16)
    gated = torch.randn(2 * 96, 96, dtype=torch.bfloat16)
    gated[:8] *= 40

    out = native_linear.native_linear(x, native_linear.pack(weight), bias)
    gated_out = native_linear.native_gated_linear(x, native_linear.pack_gated(gated))
    tiles_restored.use_tiles(False)
    vector_out = native_linear.native_linear(x, native_linear.pack(weight), bias)
    vector_gated = native_linear.native_gated_linear(x, native_linear.pack_gated(gated))

    expected = _reference(x, weight, bias)
    assert ((out.double() - expected).abs() <= 2.0**-7 * expected.abs() + 1e-4).all()
    torch.testing.assert_close(out, vector_out, rtol=2.0**-7, atol=1e-4)  # fp32 sums, in another order
    gate, up = F.linear(x, gated).chunk(2, dim=-1)
    assert not gated_out.isnan().any()
    torch.testing.assert_close(gated_out, F.silu(gate) * up, rtol=2.0**-6, atol=1e-3)
    torch.testing.assert_close(gated_out, vector_gated, rtol=2.0**-6, atol=1e-3)


def test_fp32_prefill_row_counts_stay_on_the_kernel(monkeypatch):
    """Every row count runs the kernel, fp32 too (no copy of the weight is kept for torch's GEMM): 1,000 rows,
    passes of 11 and 12 rows, give F.linear's sums and the gated product up to fp32 rounding."""
    kernels, kernel_rows = native.library(), []
    monkeypatch.setattr(kernels, "linear", lambda x, *rest, run=kernels.linear: kernel_rows.append(len(x)) or run(x, *rest))
    monkeypatch.setattr(kernels, "gated_linear", lambda x, *rest, run=kernels.gated_linear: kernel_rows.append(len(x)) or run(x, *rest))
    weight, bias, gated = torch.randn(224, 96), torch.randn(224), torch.randn(2 * 64, 96)
    many = torch.randn(1000, 96)

    torch.testing.assert_close(native_linear.native_linear(many, native_linear.pack(weight), bias),
                               F.linear(many, weight, bias), rtol=1e-5, atol=1e-4)
    gate, up = F.linear(many, gated).chunk(2, dim=-1)
    torch.testing.assert_close(native_linear.native_gated_linear(many, native_linear.pack_gated(gated)),
                               F.silu(gate) * up, rtol=1e-5, atol=1e-4)
    assert kernel_rows == [1000, 1000]


def test_the_engine_calls_the_cpp_bodied_ops_where_the_kernels_build():
    """Built against this torch's headers wherever the plain kernels build (torch ships them): the engine's
    linears (engines/builtin/cpu_linear.py) then skip the Python-bodied op's ~12 us a call."""
    assert native.library() is not None and native.torch_ops()
    assert native_linear.ops() == (torch.ops.parrot_native.linear, torch.ops.parrot_native.gated_linear)


# Each C++ body against the Python-bodied op it stands in for: bf16 and fp32, with and without a bias, a strided
# input, one pass of rows or several.
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [0, 1, 7, 33, 100])
def test_cpp_bodied_ops_equal_the_python_bodied(dtype, rows):
    torch.manual_seed(rows)
    linear, gated = native_linear.ops()
    weight, bias = torch.randn(128, 96, dtype=dtype), torch.randn(128, dtype=dtype)
    x = torch.randn(96, rows, dtype=dtype).t()  # rows not contiguous
    packed, gated_packed = native_linear.pack(weight), native_linear.pack_gated(weight)
    for args in ((x, packed, bias), (x, packed, None)):
        assert torch.equal(linear(*args), native_linear.native_linear(*args))
    assert torch.equal(gated(x, gated_packed), native_linear.native_gated_linear(x, gated_packed))


def test_cpp_bodied_ops_refuse_what_the_python_bodied_refuse():
    linear, gated = native_linear.ops()
    weight = torch.randn(32, 32)
    packed = native_linear.pack(weight)
    for x, bias in ((torch.randn(1, 64), None), (torch.randn(32), None), (torch.randn(1, 32, dtype=torch.bfloat16), None),
                    (torch.randn(1, 32), torch.randn(4)), (torch.randn(1, 32), torch.randn(32, dtype=torch.float64))):
        with pytest.raises(ValueError, match="does not take"):
            linear(x, packed, bias)
    with pytest.raises(ValueError, match="does not take"):  # a weight not packed for it
        linear(torch.randn(1, 32), weight, None)
    with pytest.raises(ValueError, match="does not take"):
        gated(torch.randn(1, 64), native_linear.pack_gated(torch.randn(64, 32)))


@pytest.mark.slow  # torch.compile
def test_a_compiled_graph_calls_the_cpp_bodied_op():
    weight = torch.randn(64, 32)
    packed = native_linear.pack(weight)
    linear = native_linear.ops()[0]

    @torch.compile(fullgraph=True, dynamic=True)
    def step(x):
        return torch.relu(linear(x, packed, None)) + 1

    # keyed by the operators' schemas, as the engine's compiled forward is: a graph cached before an operator's
    # schema changed would call it with the arguments it had
    with native.keyed_by_operators():
        for rows in (1, 5, 40):
            x = torch.randn(rows, 32)
            torch.testing.assert_close(step(x), torch.relu(F.linear(x, weight)) + 1, rtol=2.0**-20, atol=1e-5)
