"""The unquantized model's linears on CPU: every call on the C++ kernel (kernels/native_linear.py).

Why: torch's CPU linears pay for generality at the row counts an engine runs. A decode step is one
pass over every weight with a few rows; oneDNN's bf16 GEMM streams them below a plain read's rate with one
row and re-lays bf16 weights out on every call unless prepacked, torch's fp32 GEMV more slowly still (figures:
docs/engine.md, "Measurements behind design choices"). The kernel reads
weights packed once at load time at a plain read's rate for 1-8 rows, and bf16 (on AMX tiles where the
CPU has them) is level with or ahead of prepacked oneDNN up to 1,000-row prefills (``python
benchmarks/kernels.py --cpu``), and fp32 level with or ahead of torch's MKL GEMM (kernels/native_linear.py).
On AVX2 CPUs without AVX-512 (no bf16 dot product) the kernel widens bf16 weights to fp32 as it reads them: half fp32's
weight bytes, so bf16 decodes faster than fp32 there and prefills about level (`auto` still picks fp32 on them).
The packed copy replaces the weight, in either dtype. A tied head packs its own copy beside the embedding it
shares. An MLP's gate-and-up projection writes silu(gate) * up directly (the kernel's gated variant), not gate
and up for a separate kernel to combine.
"""

from __future__ import annotations

import torch
from torch import nn

from engines.builtin.model import MLP
from kernels import native_linear


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX tiles)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


class NativeLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # Buffers move with the module; not saved (made from the checkpoint's weight at load).
        self.register_buffer("packed", native_linear.pack(linear.weight), persistent=False)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().clone(), persistent=False)
        self.op = native_linear.ops()[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self.op(rows, self.packed, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


class NativeGatedLinear(nn.Module):
    """An MLP's fused gate-and-up projection [2I, K] whose output is silu(gate) * up [.., I]."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features // 2
        self.register_buffer("packed", native_linear.pack_gated(linear.weight), persistent=False)
        self.op = native_linear.ops()[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        out = self.op(rows, self.packed)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features} (silu(gate) * up)"


class NativeMLP(nn.Module):
    """MLP on the kernel: its gate_up_proj (a NativeGatedLinear) applies the activation itself."""

    def __init__(self, mlp: MLP):
        super().__init__()
        self.gate_up_proj = NativeGatedLinear(mlp.gate_up_proj)
        self.down_proj = NativeLinear(mlp.down_proj)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.gate_up_proj(x))


def prepare_cpu_linears(model: nn.Module) -> None:
    """Replaces each nn.Linear of an unquantized CPU model whose weight the kernel takes (its dtype has
    the kernel built here, its sizes fit the kernel's blocks) by a NativeLinear, and each MLP whose two
    projections it takes by a NativeMLP; others stay torch's."""
    mlps = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
            if type(child) is MLP and _kernel_takes(child)]
    for parent, name, mlp in mlps:
        setattr(parent, name, NativeMLP(mlp))
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if type(child) is nn.Linear and native_linear.fits(child.weight)]
    for parent, name, linear in targets:
        setattr(parent, name, NativeLinear(linear))


def _kernel_takes(mlp: MLP) -> bool:
    """Whether both of the MLP's projections are plain bias-free linears the kernel takes, gated by SiLU (the only
    activation the gated kernel computes; Gemma's GELU MLPs keep a plain gate-and-up linear)."""
    gate_up, down = mlp.gate_up_proj, mlp.down_proj
    return (mlp.activation_name == "silu" and type(gate_up) is nn.Linear and type(down) is nn.Linear and gate_up.bias is None and down.bias is None
            and native_linear.fits_gated(gate_up.weight) and native_linear.fits(down.weight))
