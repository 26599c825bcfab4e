import pytest
import torch

from kernels import reference
from kernels.kv_write import kv_write
from tests.triton_mode import TRITON_MARKS

pytestmark = TRITON_MARKS


@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_writes_slots_and_skips_padding(kv, slot_dtype):
    slots = torch.tensor([5, -1, 17, 95 * kv.block_size + 3, -1, 0, kv.block_size], dtype=slot_dtype)
    key = torch.randn(len(slots), kv.num_kv_heads, kv.head_dim).to(kv.k_cache.dtype)
    value = torch.randn_like(key)
    expected_k, expected_v = kv.k_cache.clone(), kv.v_cache.clone()
    reference.kv_write(key, value, expected_k, expected_v, slots)

    kv_write(key, value, kv.k_cache, kv.v_cache, slots)

    assert torch.equal(kv.k_cache, expected_k) and torch.equal(kv.v_cache, expected_v)
    assert torch.equal(kv.k_cache[0, 5], key[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_casts_to_the_cache_dtype(kv):
    key = torch.randn(2, kv.num_kv_heads, kv.head_dim)
    kv_write(key, key, kv.k_cache, kv.v_cache, torch.tensor([3, 40]))
    # within one bf16 step rather than equal: the interpreter truncates fp32 -> bf16 where GPUs round
    torch.testing.assert_close(kv.k_cache[2, 8].float(), key[1], atol=0, rtol=2**-7)
    assert kv.k_cache[2, 8].dtype == torch.bfloat16


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_rejects_wrong_head_count(kv):
    key = torch.randn(2, kv.num_kv_heads + 1, kv.head_dim)
    with pytest.raises(ValueError, match=r"key.shape\[1\] must be 3"):
        kv_write(key, key, kv.k_cache, kv.v_cache, torch.tensor([3, 40]))
