"""Where the Triton kernels run in tests: compiled, on a CUDA GPU when there is one; otherwise on CPU
through Triton's interpreter. Import this before anything imports a ``kernels.*`` Triton module:
``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is imported."""

import os

import pytest
import torch

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"

# A module of Triton kernel tests sets ``pytestmark = TRITON_MARKS``: through the interpreter each case takes seconds.
TRITON_MARKS = [] if GPU else [pytest.mark.slow]
