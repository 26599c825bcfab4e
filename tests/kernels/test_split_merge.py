import torch

from kernels.split_merge import merge_splits
from tests.triton_mode import TRITON_MARKS

pytestmark = TRITON_MARKS


def test_merges_by_log_sum_exp_and_ignores_empty_splits():
    batch, heads, splits, dim = 3, 9, 5, 64
    scores = torch.randn(batch, heads, splits, 7)  # 7 keys per split, values below
    values = torch.randn(batch, heads, splits, 7, dim)
    scores[0, :, 1] = float("-inf")  # an empty split in the middle
    scores[2] = float("-inf")  # a row with no keys at all
    lse = torch.logsumexp(scores, dim=-1)  # natural log, [B, H, S]
    partial = torch.einsum("bhsk,bhskd->bhsd", torch.softmax(scores, dim=-1).nan_to_num(), values)
    partial[lse == float("-inf")] = float("nan")  # what uninitialised memory may hold
    out = torch.empty(batch, heads, dim)

    merge_splits(partial, lse * 1.4426950408889634, out)  # the kernels keep lse in base 2

    flat = torch.softmax(scores.flatten(2), dim=-1).nan_to_num()  # attention over all splits at once
    expected = torch.einsum("bhk,bhkd->bhd", flat, values.flatten(2, 3))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.all(out[2] == 0)
