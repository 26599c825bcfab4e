import pytest
import torch

from kernels import reference
from kernels.paged_decode import choose_num_splits, paged_decode
from tests.triton_mode import TRITON_MARKS, pairwise

pytestmark = TRITON_MARKS

RAGGED = [1, 37, 100, 0, 64, 16, 129]  # one token, mid-block, block edges, an empty (padding) row


# Pairwise, not the product: each page size with each dtype, each with each split choice.
@pairwise("block_size, dtype, num_splits", [(16, torch.float32, 1), (32, torch.bfloat16, 1), (16, torch.bfloat16, 3),
                                            (32, torch.float32, 3), (32, torch.float32, None),
                                            (16, torch.bfloat16, None)])
def test_matches_reference(kv, tol, num_splits):
    lens = torch.tensor(RAGGED, dtype=torch.int32)
    tables = kv.block_tables(RAGGED)
    q = kv.queries(len(RAGGED))

    out = paged_decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale, num_splits=num_splits)

    expected = reference.paged_decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale)
    torch.testing.assert_close(out, expected, **tol)
    assert torch.all(out[3] == 0), "a row with no context must be zeros, not NaN"


# fp32 only: the window is which keys a row reads, the same in either dtype (bf16's arithmetic: test_matches_reference);
# under Triton's interpreter each case takes seconds, so pairwise over page size, window and splits.
@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pairwise("block_size, window, num_splits", [(16, 1, 1), (32, 1, 3), (32, 20, 1), (16, 20, 3), (16, 64, 1),
                                             (32, 64, 3)])
def test_sliding_window_matches_reference(kv, tol, window, num_splits):
    """Each query sees only its last `window` keys; splits wholly before the window stay empty."""
    lens = torch.tensor(RAGGED, dtype=torch.int32)
    tables = kv.block_tables(RAGGED)
    q = kv.queries(len(RAGGED))

    out = paged_decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale, num_splits=num_splits, window=window)

    expected = reference.paged_decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale, window)
    torch.testing.assert_close(out, expected, **tol)
    whole = reference.paged_decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale)
    assert not torch.allclose(out[-1], whole[-1], **tol), "the window must cut the longest row's context"


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_more_splits_than_tokens_leaves_empty_splits_harmless(kv, tol):
    lens = torch.tensor([5, 70], dtype=torch.int32)
    tables = kv.block_tables([5, 70], width=12)  # 192 tokens of table: most of the 8 splits are empty
    q = kv.queries(2)

    out = paged_decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale, num_splits=8)

    torch.testing.assert_close(out, reference.paged_decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale), **tol)


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_rejects_bad_arguments(kv):
    lens = torch.tensor([4, 4], dtype=torch.int32)
    tables = kv.block_tables([4, 4])
    q = kv.queries(2)
    with pytest.raises(ValueError, match="q must have 3 dims"):
        paged_decode(q[0], kv.k_cache, kv.v_cache, tables, lens, kv.scale)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_decode(q[:, :8], kv.k_cache, kv.v_cache, tables, lens, kv.scale)
    with pytest.raises(ValueError, match="dtype"):
        paged_decode(q.bfloat16(), kv.k_cache, kv.v_cache, tables, lens, kv.scale)
    with pytest.raises(ValueError, match=r"context_lens.shape\[0\] must be 2"):
        paged_decode(q, kv.k_cache, kv.v_cache, tables, lens[:1], kv.scale)
    with pytest.raises(ValueError, match="block_tables must have dtype"):
        paged_decode(q, kv.k_cache, kv.v_cache, tables.float(), lens, kv.scale)
    with pytest.raises(ValueError, match="unit stride"):
        paged_decode(q.transpose(1, 2).contiguous().transpose(1, 2), kv.k_cache, kv.v_cache, tables, lens, kv.scale)


def test_split_choice_fills_the_gpu_only_when_the_batch_cannot():
    assert choose_num_splits(batch=1, num_kv_heads=3, max_context_len=4096, num_sms=132) == 32
    assert choose_num_splits(batch=256, num_kv_heads=8, max_context_len=4096, num_sms=132) == 1
    assert choose_num_splits(batch=1, num_kv_heads=3, max_context_len=100, num_sms=132) == 1
