"""The C++ row argmax (kernels/native/argmax.cpp) a greedy batch samples with: torch.argmax's answers."""

import pytest
import torch


@pytest.mark.parametrize("rows, cols", [(1, 49152), (16, 49152), (3, 49155), (5, 16), (4, 33), (2, 7), (3, 1), (0, 8)])
def test_equals_torch_argmax(kernels, rows, cols):
    """Whole vectors and a tail past them, rows shorter than a vector, one column, no rows."""
    logits = torch.randn(rows, cols, generator=torch.Generator().manual_seed(rows * cols))

    assert kernels.argmax_rows(logits) == logits.argmax(dim=-1).tolist()


def test_ties_infinities_and_nans_as_torch_answers_them(kernels, two_threads):
    logits = torch.randn(9, 1000, generator=torch.Generator().manual_seed(0))
    logits[0, [20, 35, 500]] = 50.0  # ties in different lanes, the lower lane holding the later index: the first
    logits[1, [3, 19]] = 50.0  # ties in the same lane
    logits[2, [40, 995]] = 50.0  # a tie between a lane and the tail past the last whole vector
    logits[3] = float("-inf")  # all equal: index 0
    logits[4, [9, 700]] = float("inf")
    logits[5, [600, 20]] = float("nan")  # a NaN is above any number: the first NaN
    logits[6, 998] = float("nan")  # a NaN in the tail
    logits[7, 5], logits[7, 300] = float("inf"), float("nan")  # a NaN after an infinity
    logits[8] = -1.0
    logits[8, 35], logits[8, 20] = -0.0, 0.0  # zeros of both signs are equal: the first, in a higher lane

    assert kernels.argmax_rows(logits) == logits.argmax(dim=-1).tolist() == [20, 3, 40, 0, 9, 20, 998, 300, 20]


@pytest.mark.parametrize("at", [0, 4])
def test_a_nan_in_a_row_shorter_than_a_vector(kernels, at):
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.5, 7.0, 1.5]])
    logits[0, at] = float("nan")

    assert kernels.argmax_rows(logits) == logits.argmax(dim=-1).tolist() == [at]


def test_rows_apart_in_memory(kernels):
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(1))[:, 10:60]  # row stride 100, 50 columns
    one_row = torch.randn(50, 1, generator=torch.Generator().manual_seed(2)).t()  # stride(0) 1: meaningless for a row

    assert kernels.argmax_rows(logits) == logits.argmax(dim=-1).tolist()
    assert kernels.argmax_rows(one_row) == one_row.argmax(dim=-1).tolist()


@pytest.mark.parametrize("logits", [torch.zeros(2, 8, dtype=torch.bfloat16), torch.zeros(8), torch.zeros(2, 0),
                                    torch.zeros(8, 2).t(), torch.zeros(2, 8, device="meta")],
                         ids=["bf16", "1-D", "no columns", "columns apart", "not on the CPU"])
def test_declines_what_it_does_not_take(kernels, logits):
    """None, so that the sampler keeps torch's argmax."""
    assert kernels.argmax_rows(logits) is None
