"""A linear layer on the C++ kernel in native/linear.cpp, as a torch op (``parrot::native_linear``) so that
compiled graphs call it too.

The op is declared with torch.library.Library rather than the custom_op decorator: a decode step makes one call
per linear, and the decorator's Python wrapper costs several times more per call. Every row count stays on the
kernel, fp32 and bf16 alike (a prefill's rows interleaved for the passes, native/linear.cpp's interleaved_rows),
so no copy of the weights is kept for torch's GEMM. How it compares with oneDNN's and MKL's GEMMs:
``python -m benchmarks.kernels --cpu`` (its "linear" rows) and ``python -m benchmarks.kernel_revisions``; earlier
measurements are listed in docs/benchmarks/history.md.
"""

from __future__ import annotations

import torch

from kernels import native

_library = torch.library.Library("parrot", "FRAGMENT")
_library.define("native_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


def _native_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return native.library().linear(x, packed, bias)


_library.impl("native_linear", _native_linear, "CPU")


@torch.library.register_fake("parrot::native_linear")
def _(x, packed, bias):
    return x.new_empty(x.shape[0], native.linear_shape(packed)[0])


native_linear = torch.ops.parrot.native_linear  # (x [rows, K], pack(weight), bias) -> [rows, N]

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
    bodies spare each call the time it spent in Python (a decode step makes one per linear). Looked up when a
    linear is made, never per call."""
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
