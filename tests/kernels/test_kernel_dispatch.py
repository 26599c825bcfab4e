"""The CPU path of kernels.dispatch: what the engine runs on a machine without a GPU."""

import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_attention, dispatch, native, reference

SUFFIX_LENS = [3, 0, 40, 1, 17, 0]
PREFIX_IDS = [0, 1, -1, 0, 1, -1]
PREFIX_LENS = [70, 33]


@pytest.fixture(params=["native", "torch"])
def decode_path(request, monkeypatch):
    """Decode on CPU runs the C++ kernels where they build, else the torch paths: both are checked."""
    native.library.cache_clear()
    if request.param == "torch":
        monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert (native.library() is not None) == (request.param == "native")
    yield request.param
    native.library.cache_clear()


def test_decode_matches_reference(kv, tol, decode_path):
    lens = [1, 37, 100, 0, 64]
    tables = kv.block_tables(lens)
    q = kv.queries(len(lens))
    args = (q, kv.k_cache, kv.v_cache, tables, torch.tensor(lens, dtype=torch.int32), kv.scale)
    out = dispatch.decode_attention(*args)
    torch.testing.assert_close(out, reference.paged_decode(*args), **tol)
    assert not out.isnan().any()


def test_prefill_matches_reference(kv, tol, decode_path):
    """Fresh prompts, chunks over a cached prefix (ending mid-block, shorter than a block, block-aligned,
    several tiles long), a sequence with no new tokens."""
    q_lens, context = [5, 70, 1, 0, 3, 20, 130], [5, 100, 50, 12, 10, 84, 170]
    tables = kv.block_tables(context, width=12)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = kv.queries(sum(q_lens))
    context_lens = torch.tensor(context, dtype=torch.int32)
    out = dispatch.prefill_attention(q, kv.k_cache, kv.v_cache, tables, cu, context_lens, 130, kv.scale)
    expected = reference.paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu, context_lens, kv.scale)
    torch.testing.assert_close(out, expected, **tol)
    plan = cpu_attention.plan_prefill(tables, cu, context_lens, kv.block_size, native_dtype=kv.k_cache.dtype)
    tiles = [-(-n // cpu_attention.native_tile_tokens()) for n in q_lens if n]
    assert [len(chunk.cached_rows.prefix_len) for chunk in plan] == tiles  # every chunk, in tiles


def test_shared_prefix_decode_matches_reference(kv, tol, decode_path):
    q = kv.queries(len(PREFIX_IDS))
    args = (
        q, kv.k_cache, kv.v_cache, torch.tensor(PREFIX_IDS, dtype=torch.int32), kv.block_tables(PREFIX_LENS),
        torch.tensor(PREFIX_LENS, dtype=torch.int32), kv.block_tables(SUFFIX_LENS),
        torch.tensor(SUFFIX_LENS, dtype=torch.int32), kv.scale,
    )
    out = dispatch.shared_prefix_decode_attention(*args)
    torch.testing.assert_close(out, reference.shared_prefix_decode(*args), **tol)
    assert torch.all(out[-1] == 0)
    # The three CPU paths are covered: prefix 0's short suffixes (3, 1) go through one masked call
    # over joined keys; prefix 1 (a member with no suffix) and the unshared rows do not.
    plan = cpu_attention.plan_shared_prefix(*args[3:8], kv.block_size, query_group=kv.num_heads // kv.num_kv_heads)
    assert [group.joined is not None for group in plan.groups] == [True, False, False]


def test_one_plan_serves_every_layer_as_the_calls_without_one(kv, decode_path):
    """The engine plans a step's reads once and passes the plan to each layer's call, whose caches differ."""
    layers = [(kv.k_cache, kv.v_cache), (kv.v_cache.flip(0).contiguous(), kv.k_cache.flip(0).contiguous())]
    lens = torch.tensor([1, 37, 100, 0, 64], dtype=torch.int32)
    tables, q = kv.block_tables(lens.tolist()), kv.queries(len(lens))
    decode = cpu_attention.plan_decode(tables, lens, kv.block_size)

    cu, context = torch.tensor([0, 5, 75, 76, 76], dtype=torch.int32), torch.tensor([5, 100, 50, 12], dtype=torch.int32)
    prefill_tables, prefill_q = kv.block_tables(context.tolist()), kv.queries(76)
    prefill = cpu_attention.plan_prefill(prefill_tables, cu, context, kv.block_size,
                                         native_dtype=kv.k_cache.dtype if decode_path == "native" else None)  # as the engine plans it

    shared_args = (torch.tensor(PREFIX_IDS, dtype=torch.int32), kv.block_tables(PREFIX_LENS),
                   torch.tensor(PREFIX_LENS, dtype=torch.int32), kv.block_tables(SUFFIX_LENS),
                   torch.tensor(SUFFIX_LENS, dtype=torch.int32))
    shared = cpu_attention.plan_shared_prefix(*shared_args, kv.block_size, query_group=kv.num_heads // kv.num_kv_heads)
    shared_q = kv.queries(len(PREFIX_IDS))
    for k_cache, v_cache in layers:
        args = (q, k_cache, v_cache, tables, lens, kv.scale)
        assert torch.equal(dispatch.decode_attention(*args, plan=decode), dispatch.decode_attention(*args))
        args = (prefill_q, k_cache, v_cache, prefill_tables, cu, context, 70, kv.scale)
        assert torch.equal(dispatch.prefill_attention(*args, plan=prefill), dispatch.prefill_attention(*args))
        args = (shared_q, k_cache, v_cache, *shared_args, kv.scale)
        assert torch.equal(dispatch.shared_prefix_decode_attention(*args, plan=shared),
                           dispatch.shared_prefix_decode_attention(*args))


def test_write_kv_matches_reference(kv):
    slots = torch.tensor([5, -1, 17, 0, -1, 3 * kv.block_size])
    key = torch.randn(len(slots), kv.num_kv_heads, kv.head_dim).to(kv.k_cache.dtype)
    expected_k, expected_v = kv.k_cache.clone(), kv.v_cache.clone()
    reference.kv_write(key, -key, expected_k, expected_v, slots)
    dispatch.write_kv(key, -key, kv.k_cache, kv.v_cache, slots)
    assert torch.equal(kv.k_cache, expected_k) and torch.equal(kv.v_cache, expected_v)


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
def test_prompt_then_decode_equals_dense_causal_attention(kv, tol, decode_path):
    """The engine's flow: write a chunked prompt's KV, prefill it, decode one more token; every
    output must equal causal attention over contiguous K/V."""
    total, chunk = 45, 30
    keys = torch.randn(total, kv.num_kv_heads, kv.head_dim)
    values = torch.randn(total, kv.num_kv_heads, kv.head_dim)
    queries = torch.randn(total, kv.num_heads, kv.head_dim)
    table = kv.block_tables([total])
    slots = table[0, torch.arange(total) // kv.block_size] * kv.block_size + torch.arange(total) % kv.block_size

    dispatch.write_kv(keys[:chunk], values[:chunk], kv.k_cache, kv.v_cache, slots[:chunk])
    first = dispatch.prefill_attention(
        queries[:chunk], kv.k_cache, kv.v_cache, table, torch.tensor([0, chunk], dtype=torch.int32),
        torch.tensor([chunk], dtype=torch.int32), chunk, kv.scale,
    )
    dispatch.write_kv(keys[chunk:-1], values[chunk:-1], kv.k_cache, kv.v_cache, slots[chunk:-1])
    second = dispatch.prefill_attention(
        queries[chunk:-1], kv.k_cache, kv.v_cache, table, torch.tensor([0, total - 1 - chunk], dtype=torch.int32),
        torch.tensor([total - 1], dtype=torch.int32), total - 1 - chunk, kv.scale,
    )
    dispatch.write_kv(keys[-1:], values[-1:], kv.k_cache, kv.v_cache, slots[-1:])
    last = dispatch.decode_attention(queries[-1:], kv.k_cache, kv.v_cache, table, torch.tensor([total], dtype=torch.int32), kv.scale)

    dense = F.scaled_dot_product_attention(
        queries.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1), is_causal=True, scale=kv.scale, enable_gqa=True
    ).transpose(0, 1)
    torch.testing.assert_close(torch.cat([first, second, last]), dense, **tol)


@pytest.mark.parametrize("dtype", [torch.float32], ids=["fp32"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_cpu_path_validates_arguments(kv):
    tables = kv.block_tables([4])
    with pytest.raises(ValueError, match="head_dim"):
        dispatch.decode_attention(kv.queries(1)[..., :32], kv.k_cache, kv.v_cache, tables, torch.tensor([4], dtype=torch.int32), kv.scale)
    with pytest.raises(ValueError, match="slot_mapping must have dtype"):
        dispatch.write_kv(torch.zeros(1, 3, 64), torch.zeros(1, 3, 64), kv.k_cache, kv.v_cache, torch.tensor([1.0]))


@pytest.mark.subprocess
def test_importing_dispatch_does_not_need_triton():
    code = "import sys, kernels; kernels.decode_attention; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)
