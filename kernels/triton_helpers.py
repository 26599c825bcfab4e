"""Small Triton pieces shared by the attention kernels."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from kernels.validation import interpreting

LOG2E = tl.constexpr(1.4426950408889634)  # kernels run softmax in base 2: exp2 is one instruction, exp is two


@triton.jit
def mma(a, b, FP32_DOT: tl.constexpr):
    """a @ b with fp32 accumulation.

    FP32_DOT upcasts both operands and asks for IEEE fp32: the Triton interpreter (3.x) returns
    garbage from a bf16 tl.dot, and fp32 caches should not silently drop to tf32 on GPU.
    """
    if FP32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        out = tl.dot(a, b)
    return out


def use_fp32_dot(dtype: torch.dtype) -> bool:
    return interpreting() or dtype == torch.float32


@functools.lru_cache(maxsize=None)
def multiprocessor_count(device_index: int) -> int:
    """SM count used to size split-K grids."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def device_sms(tensor: torch.Tensor) -> int:
    if not tensor.is_cuda:
        return 132  # interpreter runs size their grids as an H100 would
    return multiprocessor_count(tensor.device.index or 0)
