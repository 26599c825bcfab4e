"""Quantized linears for CPU decoding, where every step re-reads all weights from memory.

A 135M-parameter model in fp32 is 540 MB a step; this machine's cores stream it at ~10 GB/s
through torch's fp32 GEMV, so fp32 decoding tops out near 15 tok/s single-stream.

- ``int8``: fbgemm's dynamic int8 GEMM. Weights are int8 per output channel; activations are
  quantized per call; the products are int8 x int8 on AVX512-VNNI. 4x fewer bytes than fp32 and
  the fastest here once a step has more than a few tokens.
- ``int4``: weights 4-bit in groups of 32 along the input with a scale and a minimum per group: the GGUF
  Q4_1 layout the default model ships in, whose codes come back exactly. On the C++ kernel
  (kernels/native/linear.cpp's linear_q4, AVX2): scales and minimums kept as fp16 (as GGUF keeps them), and each
  call's rows quantized to int8 per group of 32 inputs for integer products, as llama.cpp computes Q4_1 (~1%
  relative error on a product, beside the 4-bit weights' ~10%). It ran SmolLM2's decoder linears in 0.30-0.36x
  the time of torch's weight-only int4 kernel from 1 to 256 rows on an AVX2 CPU (an AMD EPYC, one process). Where it does
  not build, torch's kernel serves (TorchInt4Linear): bf16 activations and scales, so a model answers as it does
  with ``dtype="bfloat16"``. 8x fewer bytes than fp32 for the codes (5 bits a weight with the scales) and the
  fastest for a step of a few tokens (single-stream decode). The output head stays int8, as GGUF files keep it
  (Q8_0 in SmolLM2's): 4 bits there would drop precision the source had.

Both replace the ``nn.Linear`` modules of a built model in place (embeddings stay as they are).
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from kernels import native

SCHEMES = ("int8", "int4")
INT4_GROUP_SIZE = native.Q4_GROUP  # inputs a 4-bit group's scale and minimum cover (GGUF Q4_1's 32)


class Int8Linear(nn.Module):
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


def int4_groups(weight: torch.Tensor, group_size: int = INT4_GROUP_SIZE) -> tuple[torch.Tensor, ...]:
    """An [N, K] weight as 4-bit codes [N, K] (0-15) and each group's scale and minimum [N, K / group_size], so
    that weight ~ code * scale + minimum."""
    weight = weight.detach().float()
    out_features, in_features = weight.shape
    if in_features % group_size:
        raise ValueError(f"int4 needs input sizes divisible by {group_size}, got {in_features}")
    groups = weight.view(out_features, in_features // group_size, group_size)
    low, high = groups.amin(-1, keepdim=True), groups.amax(-1, keepdim=True)
    scale = ((high - low) / 15).clamp(min=1e-12)
    codes = ((groups - low) / scale).round().clamp(0, 15).to(torch.uint8).view(out_features, in_features)
    return codes, scale.squeeze(-1), low.squeeze(-1)


class Int4Linear(nn.Module):
    """4-bit weights on the C++ kernel (parrot_native::linear_q4): rows quantized to int8 per group of 32 inputs
    inside the kernel, as llama.cpp does for Q4_1."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        if not native_int4():
            raise ValueError("the 4-bit kernel is not built here (it needs AVX2 and F16C, and the native torch operators)")
        codes, scale, low = int4_groups(linear.weight)
        self.register_buffer("packed", native.library().pack_q4(codes, scale, low))
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())
        self.out_features = linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, x.shape[-1]).float()
        out = torch.ops.parrot_native.linear_q4(rows, self.packed, self.bias)
        return out.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


class TorchInt4Linear(nn.Module):
    """4-bit weights on torch's weight-only int4 kernel (bf16 activations and scales)."""

    def __init__(self, linear: nn.Linear, group_size: int = INT4_GROUP_SIZE):
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


def native_int4() -> bool:
    """Whether the C++ 4-bit kernel serves here: built (AVX2), and the native torch operators loaded."""
    kernels = native.library()
    return kernels is not None and kernels.has_q4 and native.torch_ops()


def int4_linear(linear: nn.Linear) -> nn.Module:
    """The int4 form of ``linear``: on the C++ kernel where it serves (native_int4), else on torch's."""
    return Int4Linear(linear) if native_int4() else TorchInt4Linear(linear)


LINEARS = {"int8": Int8Linear, "int4": int4_linear}
HEAD_LINEARS = {"int8": Int8Linear, "int4": Int8Linear}


def quantize_linears(model: nn.Module, scheme: str, head: str = "lm_head") -> None:
    """Replaces every nn.Linear under ``model`` by its ``scheme`` counterpart (CPU only); the
    top-level linear named ``head`` gets the scheme's head format."""
    if scheme not in LINEARS:
        raise ValueError(f"unknown quantization {scheme!r}; choose one of {', '.join(SCHEMES)}")
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear)]
    for parent, name, linear in targets:
        kind = HEAD_LINEARS if parent is model and name == head else LINEARS
        setattr(parent, name, kind[scheme](linear))
