"""Quantized linears for CPU decoding, where every step re-reads all weights from memory.

A 135M-parameter model in fp32 is 540 MB a step, so a single stream's fp32 decoding is bound by how fast the
cores stream those bytes through torch's fp32 GEMV; fewer bytes a weight decode faster.

Both schemes run on the C++ group-quantized kernels (kernels/native/linear.cpp's linear_q8 and linear_q4,
AVX2): weights in groups of 32 inputs with an fp16 scale a group and feature, as GGUF stores them, and each
call's rows quantized to int8 per group of 32 inputs for integer products, as llama.cpp computes them (~1%
relative error on a product).

- ``int8``: GGUF's Q8_0, codes -127..127 (8.5 bits a weight with the scales; ~0.5% error on a weight). It
  answers as fp32 does far more often than fbgemm's int8 GEMM did (per-channel weights, 7-bit activations
  per tensor: benchmarks.engine_accuracy), and it ran SmolLM2's decoder linears well ahead of fbgemm's at 1 row,
  somewhat behind at 256 (docs/engine.md, "Measurements behind design choices"). Where the kernels do not build,
  or for a linear whose sizes they do not take (not multiples of 32), fbgemm's GEMM serves (FbgemmInt8Linear),
  eager only.
- ``int4``: GGUF's Q4_1, codes 0-15 and a minimum a group (weight = code * scale + minimum): the layout the
  default model ships in, whose codes come back exactly. It ran SmolLM2's decoder linears well ahead of
  torch's weight-only int4 kernel from 1 to 256 rows. Where it does not build, torch's kernel serves
  (TorchInt4Linear): bf16 activations and scales, so a model answers as it does with ``dtype="bfloat16"``. 8x
  fewer bytes than fp32 for the codes (5 bits a weight with the scales) and the fastest for a step of a few
  tokens (single-stream decode). The output head stays 8-bit (Q8_0), as GGUF files keep it (SmolLM2's
  does): 4 bits there would drop precision the source had.

Both replace the ``nn.Linear`` modules of a built model in place (embeddings stay as they are).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from kernels import native

SCHEMES = ("int8", "int4")
GROUP_SIZE = native.GROUP_INPUTS  # inputs a group's scale (and minimum) cover: GGUF Q8_0's and Q4_1's 32


def weight_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> torch.Tensor:
    """An [N, K] weight as [N, K / group_size, group_size] fp32 groups."""
    weight = weight.detach().float()
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"group quantization needs input sizes divisible by {group_size}, got {in_features}")
    return weight.view(out_features, in_features // group_size, group_size)


def int8_groups(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An [N, K] weight as int8 codes [N, K] (-127..127) and each group's scale [N, K / 32], so that
    weight ~ code * scale (GGUF's Q8_0)."""
    groups = weight_groups(weight)
    scale = (groups.abs().amax(-1, keepdim=True) / 127).clamp(min=1e-12)
    codes = (groups / scale).round().clamp(-127, 127).to(torch.int8).view(weight.shape)
    return codes, scale.squeeze(-1)


def int4_groups(weight: torch.Tensor, group_size: int = GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """An [N, K] weight as 4-bit codes [N, K] (0-15) and each group's scale and minimum [N, K / group_size], so
    that weight ~ code * scale + minimum (GGUF's Q4_1)."""
    groups = weight_groups(weight, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.uint8).view(weight.shape)
    return codes, scale.squeeze(-1), low.squeeze(-1)


class GroupedLinear(nn.Module):
    """A linear on a C++ group-quantized kernel (kernels/native/linear.cpp): rows quantized to int8 per group of
    32 inputs inside the kernel, as llama.cpp does. Subclasses pack the weight and name the operator."""

    def __init__(self, linear: nn.Linear, packed: torch.Tensor, operator):
        super().__init__()
        self.operator = operator
        self.register_buffer("packed", packed)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        out = self.operator(rows, self.packed, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def grouped_kernels() -> native.NativeKernels:
    """The library holding the group-quantized kernels, or ValueError where they do not serve (native_grouped)."""
    if not native_grouped():
        raise ValueError("the group-quantized kernels are not available here (they need AVX2, F16C and FMA, and the "
                         "native torch operators)")
    return native.library()


class Int8Linear(GroupedLinear):
    """8-bit weights (Q8_0) on the C++ kernel, parrot_native::linear_q8."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear, grouped_kernels().pack_q8(*int8_groups(linear.weight)), torch.ops.parrot_native.linear_q8)


class Int4Linear(GroupedLinear):
    """4-bit weights (Q4_1) on the C++ kernel, parrot_native::linear_q4."""

    def __init__(self, linear: nn.Linear):
        super().__init__(linear, grouped_kernels().pack_q4(*int4_groups(linear.weight)), torch.ops.parrot_native.linear_q4)


class FbgemmInt8Linear(nn.Module):
    """8-bit weights per output channel on fbgemm's dynamic int8 GEMM (activations 7-bit per tensor), where the
    C++ kernels do not build. Its packed weight is an object torch.compile cannot trace."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach().float()
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12)
        zero_points = torch.zeros(weight.shape[0], dtype=torch.long)
        bias = None if linear.bias is None else linear.bias.detach().float()
        # quantize_per_channel is deprecated in favour of torchao, which has no CPU int8 GEMM
        # as fast as fbgemm's; the packed weight is all that is kept.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            quantized = torch.quantize_per_channel(weight, scales.double(), zero_points, 0, torch.qint8)
            self.packed = torch.ops.quantized.linear_prepack(quantized, bias)
        self.out_features = weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # reduce_range: 7-bit activations, which cannot saturate AVX2's 16-bit accumulators.
        return torch.ops.quantized.linear_dynamic(x.float(), self.packed, True).to(x.dtype)


class TorchInt4Linear(nn.Module):
    """4-bit weights on torch's weight-only int4 kernel (bf16 activations and scales)."""

    def __init__(self, linear: nn.Linear, group_size: int = GROUP_SIZE):
        super().__init__()
        codes, scale, low = int4_groups(linear.weight, group_size)
        # The kernel dequantizes (code - 8) * scale + zero, so zero is the group's minimum + 8 scales.
        scales_and_zeros = torch.stack([scale, low + 8 * scale], dim=-1)  # [N, K/g, 2]
        self.register_buffer("scales_and_zeros", scales_and_zeros.transpose(0, 1).contiguous().bfloat16())
        self.register_buffer("packed", torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32), 1))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.group_size = group_size
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.ops.aten._weight_int4pack_mm_for_cpu(
            x.bfloat16(), self.packed, self.group_size, self.scales_and_zeros
        ).to(x.dtype)
        return out if self.bias is None else out + self.bias.to(x.dtype)


def native_grouped() -> bool:
    """Whether the C++ group-quantized kernels serve here: built (AVX2), and the native torch operators loaded."""
    kernels = native.library()
    return kernels is not None and kernels.has_grouped and native.torch_ops()


def on_grouped_kernels(linear: nn.Linear) -> bool:
    """Whether ``linear`` goes on the C++ group-quantized kernels: they serve here, and take its sizes."""
    return native_grouped() and native.library().takes_grouped(linear.out_features, linear.in_features)


def int8_linear(linear: nn.Linear) -> nn.Module:
    """The int8 form of ``linear``: on the C++ kernel where it goes (on_grouped_kernels), else on fbgemm's."""
    return Int8Linear(linear) if on_grouped_kernels(linear) else FbgemmInt8Linear(linear)


def int4_linear(linear: nn.Linear) -> nn.Module:
    """The int4 form of ``linear``: on the C++ kernel where it goes (on_grouped_kernels), else on torch's."""
    return Int4Linear(linear) if on_grouped_kernels(linear) else TorchInt4Linear(linear)


LINEARS = {"int8": int8_linear, "int4": int4_linear}
HEAD_LINEARS = {"int8": int8_linear, "int4": int8_linear}


class UntraceableError(ValueError):
    """torch.compile was asked for a model whose linears it cannot trace (untraceable_linears)."""


def untraceable_linears(module: nn.Module) -> list[str]:
    """The names of ``module``'s linears that torch.compile cannot trace (fbgemm's)."""
    return [name for name, child in module.named_modules() if isinstance(child, FbgemmInt8Linear)]


def quantize_linears(model: nn.Module, scheme: str, head: str = "lm_head") -> None:
    """Replaces every nn.Linear under ``model`` by its ``scheme`` counterpart (CPU only); the
    top-level linear named ``head`` gets the scheme's head format. A mixture of experts' router and shared-expert
    gate stay as they are: a few rows (torch's int4 packing takes none under 16), and rounding there changes which
    experts a token goes to rather than by how much."""
    from engines.builtin.model import MixtureOfExperts

    if scheme not in LINEARS:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and not isinstance(parent, MixtureOfExperts)]
    for parent, name, linear in targets:
        kind = HEAD_LINEARS if parent is model and name == head else LINEARS
        setattr(parent, name, kind[scheme](linear))
