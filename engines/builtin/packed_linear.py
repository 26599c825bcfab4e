"""bf16 linears with their weights prepacked for oneDNN, for CPUs with AVX-512 BF16 or AMX.

``F.linear`` on bf16 CPU tensors re-lays the weight out for oneDNN's blocked format on every call;
a decode step is one pass over all weights, so that copy is a large share of it. Packing once at
load time (``mkldnn._reorder_linear_weight``, what inductor's freezing pass does) and calling
``mkldnn._linear_pointwise`` measured 1.5x faster over the 120 decoder linears of SmolLM2 at
batch 1 and 16 here (AVX-512 BF16, 2 cores), and 2x on the vocabulary-wide head.
Activations stay bf16; oneDNN accumulates in fp32.
"""

from __future__ import annotations

import torch
from torch import nn


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX tiles)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        # Batch-size hint 1: decode steps dominate; other sizes run on the same packing (measured
        # within noise of a per-size packing at 16 and 1,000 rows).
        # Plain attributes, not buffers: an opaque oneDNN tensor has no place in a state dict or in
        # Module.to(); the model is packed after it is on its device and in its dtype.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def prepack_linears(model: nn.Module, only: list[str] | None = None) -> None:
    """Replaces every bf16 nn.Linear under ``model`` (or those of the names in ``only``) by a
    PackedLinear (CPU, fast-bf16 CPUs only)."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and child.weight.dtype == torch.bfloat16 and (only is None or name in only)]
    for parent, name, linear in targets:
        setattr(parent, name, PackedLinear(linear))
