"""A linear layer over one row (a batch-1 decode step) on the C++ kernel in native/linear.cpp, as a torch
op (``parrot::row_linear``) so that compiled graphs call it too.

A batch-1 decode step streams every weight once; oneDNN's one-row bf16 GEMM and torch's fp32 GEMV
read SmolLM2's layers at ~18 and ~12 GB/s here, the kernel at ~29, a plain read's rate (``python
benchmarks/kernels.py --cpu``, its "linear" rows), the weight blocked by pack() so that each thread
reads its part as one stream (row-major, four streams a tile: ~23). The op is declared with torch.library.Library rather than the custom_op decorator:
a decode step makes 120 of these calls and the decorator's Python wrapper cost ~15 us each (~2 us
this way).
"""

from __future__ import annotations

import torch

from kernels import native

_library = torch.library.Library("parrot", "FRAGMENT")
_library.define("row_linear(Tensor x, Tensor packed, Tensor? bias) -> Tensor")


def _row_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return native.library().linear(x, packed, bias)


_library.impl("row_linear", _row_linear, "CPU")


@torch.library.register_fake("parrot::row_linear")
def _(x, packed, bias):
    return x.new_empty(x.shape[0], native.linear_shape(packed)[0])


row_linear = torch.ops.parrot.row_linear  # (x [rows, K], pack(weight), bias) -> [rows, N]


def fits(weight: torch.Tensor) -> bool:
    """Whether row_linear takes this [N, K] weight here (the native kernels built, its dtype and tile sizes)."""
    kernels = native.library()
    return weight.device.type == "cpu" and kernels is not None and kernels.supports_linear(weight)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """The weight as the kernel reads it (a copy, blocked so that each thread streams its band in one pass)."""
    return native.pack_linear(weight.detach())
