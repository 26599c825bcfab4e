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


def pairwise(names: str, cases: list[tuple]) -> pytest.MarkDecorator:
    """A parametrize over a pairwise-covering set of ``cases``: every pair of values of any two parameters appears
    in some case, where the full product would run each case through Triton's interpreter (seconds each)."""
    fields = [name.strip() for name in names.split(",")]
    for a in range(len(fields)):
        for b in range(a + 1, len(fields)):
            wanted = {(x, y) for x in {c[a] for c in cases} for y in {c[b] for c in cases}}
            assert wanted == {(c[a], c[b]) for c in cases}, f"{fields[a]} x {fields[b]} not covered"
    return pytest.mark.parametrize(names, cases, ids=["-".join(map(_case_id, case)) for case in cases])


def _case_id(value) -> str:
    if isinstance(value, tuple):
        return "+".join(map(_case_id, value))
    return str(value).removeprefix("torch.")
