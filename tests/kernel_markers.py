"""Skip markers for tests of the C++ kernels' optional paths (imported by test modules that import kernels anyway;
tests/conftest.py must not import kernels at its top)."""

import pytest
import torch

from engines.builtin.quantization import native_grouped
from kernels import native_linear

# bf16 linears on the C++ kernel: a bf16 dot product (AVX-512 BF16 / AMX) or weights widened to fp32 (AVX2 without
# AVX-512). Where neither is built, bf16 linears stay torch's.
needs_bf16 = pytest.mark.skipif(not native_linear.fits(torch.zeros(32, 2, dtype=torch.bfloat16)),
                                reason="the kernels here have no bf16 path (AVX-512 BF16 / AMX, or AVX2 without AVX-512)")

# int8 and int4 on the C++ group-quantized kernels (AVX2, F16C and FMA, with the native torch operators). Where they are
# not built, int8 stays on fbgemm's kernel and int4 on torch's (FbgemmInt8Linear, TorchInt4Linear), which the tests
# of both run on everywhere.
needs_grouped = pytest.mark.skipif(not native_grouped(),
                                   reason="the kernels here have no group-quantized path (AVX2, F16C and FMA)")
