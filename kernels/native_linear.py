"""A linear layer on the C++ kernel in native/linear.cpp, as a torch op (``parrot::native_linear``) so that
compiled graphs call it too.

Measured over SmolLM2's 120 decoder linears on an AVX-512 host (``python benchmarks/kernels.py --cpu``, its
"linear" rows, 2 cores): a decode step's few rows stream the packed weights at a plain read's rate where
oneDNN's one-row bf16 GEMM reached ~18 GB/s and torch's fp32 GEMV ~12; at 16 rows bf16 takes ~12 ms
against oneDNN's ~16, and up to 1,000 rows (prefill) it stayed level with oneDNN's prepacked bf16 GEMM
and torch's fp32 GEMM, both near that CPU's multiply-add peak. The op is declared with
torch.library.Library rather than the custom_op decorator: a decode step makes 120 of these calls and
the decorator's Python wrapper cost ~15 us each (~2 us this way).

fp32 calls of the plain op may also pass the unpacked weight: from ``GEMM_ROWS`` rows on they go to torch's
GEMM instead. On this Emerald Rapids host (2 cores, SmolLM2's decoder linears, 30 layers' weights, the two
alternating in one process) the kernel's fp32 multiply-adds ran 1.45x torch's F.linear (MKL) at 32-48 rows,
1.11x at 64, 0.94x at 96-128 and 0.93-1.04x from 192 to 1,000. The gated op takes the kernel at every row
count: against F.linear, silu and a multiply it ran 1.09-1.2x as fast from 64 to 1,000 rows (it never writes
gate and up), so fp32 keeps no second copy of the MLP's largest weight. bf16 keeps the kernel at every row
count: its tiles (AMX) were level with or ahead of oneDNN.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels import native

GEMM_ROWS = 96  # fp32 rows from which a call that passes its weight goes to torch's GEMM

_library = torch.library.Library("parrot", "FRAGMENT")
_library.define("native_linear(Tensor x, Tensor packed, Tensor? bias, Tensor? weight=None) -> Tensor")


def _native_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                   weight: torch.Tensor | None = None) -> torch.Tensor:
    if weight is not None and x.shape[0] >= GEMM_ROWS:
        return F.linear(x, weight, bias)
    return native.library().linear(x, packed, bias)


_library.impl("native_linear", _native_linear, "CPU")


@torch.library.register_fake("parrot::native_linear")
def _(x, packed, bias, weight=None):
    return x.new_empty(x.shape[0], native.linear_shape(packed)[0])


native_linear = torch.ops.parrot.native_linear  # (x [rows, K], pack(weight), bias[, weight]) -> [rows, N]

_library.define("native_gated_linear(Tensor x, Tensor packed) -> Tensor")


def _native_gated_linear(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    return native.library().gated_linear(x, packed)


_library.impl("native_gated_linear", _native_gated_linear, "CPU")


@torch.library.register_fake("parrot::native_gated_linear")
def _(x, packed):
    return x.new_empty(x.shape[0], native.linear_shape(packed)[0] // 2)


# (x [rows, K], pack_gated(weight [2I, K])) -> silu(x @ gate.T) * (x @ up.T) [rows, I]
native_gated_linear = torch.ops.parrot.native_gated_linear


def ops() -> tuple:
    """(linear, gated_linear) as the engine calls them: the C++-bodied parrot_native ops (native/torch_ops.cpp,
    the same contracts) where native.torch_ops() loads them here, else the Python-bodied ones above. The C++
    bodies spare a call the ~12 us it spent in Python (a decode step makes 120). Looked up when a linear is
    made, never per call."""
    if not native.torch_ops():
        return native_linear, native_gated_linear
    return torch.ops.parrot_native.linear, torch.ops.parrot_native.gated_linear


def fits(weight: torch.Tensor) -> bool:
    """Whether native_linear takes this [N, K] weight here (the native kernels built, its dtype and block sizes)."""
    kernels = native.library()
    return weight.device.type == "cpu" and kernels is not None and kernels.supports_linear(weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight as the kernel reads it (a copy: for each block of output features, one sequential stream)."""
    return native.pack_linear(weight.detach())


def fits_gated(weight: torch.Tensor) -> bool:
    """Whether native_gated_linear takes this [2I, K] gate-and-up weight here (I a multiple of the block)."""
    return fits(weight) and weight.shape[0] % (2 * native.LINEAR_BLOCK) == 0


def pack_gated(weight: torch.Tensor) -> torch.Tensor:
    """A gate-and-up weight (gate rows first) as the gated kernel reads it: their blocks alternate."""
    return native.pack_gated_linear(weight.detach())
