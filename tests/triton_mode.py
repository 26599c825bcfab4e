"""Where the Triton kernels run in tests: compiled, on a CUDA GPU when there is one; otherwise on CPU
through Triton's interpreter. Import this before anything imports a ``kernels.*`` Triton module:
``triton.jit`` reads TRITON_INTERPRET when a kernel is decorated, i.e. when its module is imported."""

import os

import torch

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")
if not GPU:
    os.environ["TRITON_INTERPRET"] = "1"
