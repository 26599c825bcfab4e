"""The unquantized model's linears on CPU: one-row steps on the C++ row kernel, the rest on oneDNN.

- ``RowLinear``: an nn.Linear whose one-row calls (batch-1 decode) go to ``kernels.row_linear``,
  which streams its blocked copy of the weight at ~29 GB/s where oneDNN's bf16 GEMM with one row
  reaches ~18 and torch's fp32 GEMV less. Other calls are F.linear's, so a compiled graph's
  freezing still prepacks them for oneDNN. The copy costs the linears' memory once more.
- ``PackedLinear`` (eager bf16, CPUs with AVX-512 BF16 or AMX): ``F.linear`` on bf16 CPU tensors
  re-lays the weight out for oneDNN's blocked format on every call; a decode step is one pass over
  all weights, so that copy is a large share of it. Packing once at load time
  (``mkldnn._reorder_linear_weight``, what inductor's freezing pass does) and calling
  ``mkldnn._linear_pointwise`` measured 1.5x faster over the 120 decoder linears of SmolLM2 at
  batch 1 and 16 here, and 2x on the vocabulary-wide head. Activations stay bf16; oneDNN
  accumulates in fp32. Its one-row calls go to the row kernel too, on its own blocked copy
  beside oneDNN's (twice the linears' memory).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kernels import row_linear


def cpu_has_fast_bf16() -> bool:
    """Whether this CPU multiplies bf16 natively (AVX-512 BF16 or AMX tiles)."""
    return torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported()


class RowLinear(nn.Linear):
    def __init__(self, linear: nn.Linear):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device="meta", dtype=linear.weight.dtype)
        self.weight, self.bias = linear.weight, linear.bias  # shared, not copied (a tied head stays tied)
        # The row kernel's blocked copy (buffers move with the module; not saved: made from the weight).
        self.register_buffer("row_weight", row_linear.pack(self.weight) if row_linear.fits(self.weight) else None,
                             persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_weight is not None and x.dim() == 2 and x.shape[0] == 1:
            return row_linear.row_linear(x, self.row_weight, self.bias)
        return F.linear(x, self.weight, self.bias)


class PackedLinear(nn.Module):
    def __init__(self, linear: nn.Linear):
        super().__init__()
        weight = linear.weight.detach()
        # Batch-size hint 1: decode steps dominate; other sizes run on the same packing (measured
        # within noise of a per-size packing at 16 and 1,000 rows).
        # Plain attributes, not buffers: an opaque oneDNN tensor has no place in a state dict or in
        # Module.to(); the model is packed after it is on its device and in its dtype.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, 1)
        self.row_weight = row_linear.pack(weight) if row_linear.fits(weight) else None
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.row_weight is not None and x.dim() == 2 and x.shape[0] == 1:
            return row_linear.row_linear(x, self.row_weight, self.bias)
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")


def prepare_cpu_linears(model: nn.Module, compiled: bool) -> None:
    """Replaces the nn.Linear modules of an unquantized CPU model: by PackedLinear where the model is
    bf16 on a fast-bf16 CPU (a compiled model's head only: freezing packs its decoder's), by
    RowLinear elsewhere."""
    targets = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()
               if isinstance(child, nn.Linear) and not isinstance(child, RowLinear)]
    for parent, name, linear in targets:
        packs = linear.weight.dtype == torch.bfloat16 and cpu_has_fast_bf16() and (not compiled or name == "lm_head")
        setattr(parent, name, PackedLinear(linear) if packs else RowLinear(linear))
