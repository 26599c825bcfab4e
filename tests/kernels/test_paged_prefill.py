import pytest
import torch

from kernels import reference
from kernels.paged_prefill import paged_prefill
from tests.triton_mode import TRITON_MARKS

pytestmark = TRITON_MARKS


def packed(q_lens: list[int]) -> torch.Tensor:
    cu = torch.zeros(len(q_lens) + 1, dtype=torch.int32)
    cu[1:] = torch.tensor(q_lens).cumsum(0)
    return cu


# (new tokens, context length): a fresh prompt, a long extend crossing a 64-query tile,
# one token over a cached prefix, a sequence with no new tokens, a prompt ending on a block edge
CASES = [(5, 5), (70, 100), (1, 50), (0, 12), (32, 32)]


def test_matches_reference(kv, tol):
    q_lens, context = [c[0] for c in CASES], [c[1] for c in CASES]
    tables = kv.block_tables(context)
    cu_seqlens_q, context_lens = packed(q_lens), torch.tensor(context, dtype=torch.int32)
    q = kv.queries(sum(q_lens))

    out = paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu_seqlens_q, context_lens, max(q_lens), kv.scale)

    expected = reference.paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu_seqlens_q, context_lens, kv.scale)
    torch.testing.assert_close(out, expected, **tol)


# fp32 only: the window is which keys a row reads, the same in either dtype (bf16's arithmetic: test_matches_reference);
# under Triton's interpreter each case takes seconds.
@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("window", [1, 24, 70], ids=["window1", "window24", "window70"])
def test_sliding_window_matches_reference(kv, tol, window):
    """Each query sees the last `window` tokens up to itself, over a cached prefix and across 64-query tiles."""
    q_lens, context = [c[0] for c in CASES], [c[1] for c in CASES]
    tables = kv.block_tables(context)
    cu_seqlens_q, context_lens = packed(q_lens), torch.tensor(context, dtype=torch.int32)
    q = kv.queries(sum(q_lens))

    out = paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu_seqlens_q, context_lens, max(q_lens), kv.scale,
                        window=window)

    expected = reference.paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu_seqlens_q, context_lens, kv.scale, window)
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_last_prefill_row_equals_decode_of_that_token(kv, tol):
    """The causal mask is aligned to the end of the context: the final new token sees everything."""
    from kernels.paged_decode import paged_decode

    tables = kv.block_tables([40])
    q = kv.queries(8)
    out = paged_prefill(q, kv.k_cache, kv.v_cache, tables, packed([8]), torch.tensor([40], dtype=torch.int32), 8, kv.scale)
    last = paged_decode(q[-1:], kv.k_cache, kv.v_cache, tables, torch.tensor([40], dtype=torch.int32), kv.scale)
    torch.testing.assert_close(out[-1:], last, **tol)


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_rejects_mismatched_cu_seqlens(kv):
    tables = kv.block_tables([4, 4])
    with pytest.raises(ValueError, match=r"cu_seqlens_q.shape\[0\] must be 3"):
        paged_prefill(kv.queries(8), kv.k_cache, kv.v_cache, tables, packed([4]), torch.tensor([4, 4], dtype=torch.int32), 4, kv.scale)
