"""A linear layer on the C++ kernel in native/linear.cpp, as a torch op (``parrot::native_linear``) so that
compiled graphs call it too.

Measured over SmolLM2's 120 decoder linears on an AVX-512 host (``python benchmarks/kernels.py --cpu``, its
"linear" rows, 2 cores): a decode step's few rows stream the packed weights at a plain read's rate where
oneDNN's one-row bf16 GEMM reached ~18 GB/s and torch's fp32 GEMV ~12; at 16 rows bf16 takes ~12 ms
against oneDNN's ~16, and up to 1,000 rows (prefill) it stayed level with oneDNN's prepacked bf16 GEMM
and torch's fp32 GEMM, both near that CPU's multiply-add peak. The op is declared with
torch.library.Library rather than the custom_op decorator: a decode step makes 120 of these calls and
the decorator's Python wrapper cost ~15 us each (~2 us this way).

Every row count stays on the kernel, fp32 too, so no copy of the weights is kept for torch's GEMM. fp32 calls of
32 rows or more had gone to torch's F.linear (MKL), which ran them 1.4-1.85x faster than the kernel's multiply-adds
then. Once each row's input was broadcast from memory (native/common.h's splat), on this Emerald Rapids host
(2 cores, 30 layers' weights, alternating in one process; ``python benchmarks/kernels.py --cpu``, two runs,
docs/benchmarks/kernels_cpu_fp32_rows.txt, in git before 8792654):
- the plain kernel ran 1.53-1.63x MKL's speed at 32 rows, 1.13-1.38x at 64-256, 0.89x and 1.01x at 1,000;
- the gated kernel ran 1.05-1.22x MKL's linear, silu and multiply from 64 to 1,000 rows;
- an eager fp32 engine's whole prefill step took 0.98x the time (1,000 tokens) and 0.93x (300 tokens) with every
  call on the kernel, against the plain linears on MKL from 96 rows on (the gated one on the kernel in both; a
  one-off A/B in one process, 10 alternating rounds, of a routing this file no longer has).
In an earlier run (30 layers' weights, one process, alternating) the plain kernel ran 0.93-1.04x MKL from 96 to
1,000 rows: level within this host's noise. A later session there found MKL 1.1-1.25x faster on the plain
linears at 1,024 rows (one process, alternating). A prefill's rows are now interleaved for the passes and their
output lines asked for first (native/linear.cpp's interleaved_rows, ask_for_output): a layer's 1,024-row linears
0.92x the time in a kernel A/B (docs/benchmarks/kernel_revisions_interleaved_rows_fp32.json, in git before 8792654); against MKL in a
run minutes later, 0.84-1.14x its rate on the plain ones and 1.2-1.3x on the gated one (one core and two).
bf16 keeps the kernel at every row count too: its tiles (AMX) were level with or ahead of oneDNN.
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
