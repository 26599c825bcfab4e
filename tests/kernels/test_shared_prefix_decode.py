import pytest
import torch

from kernels import reference
from kernels.paged_decode import paged_decode
from kernels.shared_prefix_decode import group_by_prefix, shared_prefix_decode
from tests.triton_mode import TRITON_MARKS, pairwise

pytestmark = TRITON_MARKS

PREFIX_LENS = [70, 0, 33]  # a multi-tile prefix, an empty one, one ending mid-block
PREFIX_IDS = [0, 2, -1, 0, 1, 2, 0, 2, -1]  # several sequences per prefix, two without any
SUFFIX_LENS = [3, 0, 40, 1, 17, 64, 9, 2, 0]  # the last one has neither prefix nor suffix


# Pairwise, not the product: each page size with each dtype, each with each split choice.
@pairwise("block_size, dtype, splits", [(16, torch.float32, (1, 1)), (32, torch.bfloat16, (1, 1)),
                                        (16, torch.bfloat16, (3, 2)), (32, torch.float32, (3, 2)),
                                        (32, torch.float32, (None, None)), (16, torch.bfloat16, (None, None))])
def test_matches_reference(kv, tol, splits):
    prefix_tables = kv.block_tables(PREFIX_LENS)
    suffix_tables = kv.block_tables(SUFFIX_LENS)
    prefix_ids = torch.tensor(PREFIX_IDS, dtype=torch.int32)
    prefix_lens, suffix_lens = torch.tensor(PREFIX_LENS, dtype=torch.int32), torch.tensor(SUFFIX_LENS, dtype=torch.int32)
    q = kv.queries(len(PREFIX_IDS))
    args = (q, kv.k_cache, kv.v_cache, prefix_ids, prefix_tables, prefix_lens, suffix_tables, suffix_lens, kv.scale)

    out = shared_prefix_decode(*args, prefix_splits=splits[0], suffix_splits=splits[1])

    torch.testing.assert_close(out, reference.shared_prefix_decode(*args), **tol)
    assert torch.all(out[-1] == 0)


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_equals_paged_decode_over_the_joined_block_table(kv, tol):
    """With a block-aligned prefix the shared kernel must agree with the plain paged kernel."""
    prefix_tables = kv.block_tables([64])
    suffix_lens = [5, 20, 33, 1]
    suffix_tables = kv.block_tables(suffix_lens)
    q = kv.queries(4)
    joined = torch.cat([prefix_tables.expand(4, -1), suffix_tables], dim=1)
    total = torch.tensor([64 + n for n in suffix_lens], dtype=torch.int32)

    shared = shared_prefix_decode(
        q, kv.k_cache, kv.v_cache, torch.zeros(4, dtype=torch.int32), prefix_tables,
        torch.tensor([64], dtype=torch.int32), suffix_tables, torch.tensor(suffix_lens, dtype=torch.int32), kv.scale,
    )
    torch.testing.assert_close(shared, paged_decode(q, kv.k_cache, kv.v_cache, joined, total, kv.scale), **tol)


def test_group_by_prefix_orders_sequences_and_marks_runs():
    seq_order, starts = group_by_prefix(torch.tensor([2, -1, 0, 2, 0], dtype=torch.int32), num_prefixes=3)
    assert seq_order.tolist() == [1, 2, 4, 0, 3]
    assert starts.tolist() == [1, 3, 3, 5]  # prefix 1 has no sequences
