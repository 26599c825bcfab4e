"""The C++ CPU decode kernels (kernels/native): built here, equal to the references, and left for the
torch paths where they cannot serve."""

import itertools
import logging

import pytest
import torch
import torch.nn.functional as F

from kernels import cpu_attention, dispatch, native, reference

RAGGED = [1, 37, 100, 0, 64, 16, 129]  # one token, mid-block, block edges, an empty (padding) row
PREFIX_LENS = [70, 0, 33]  # a multi-chunk prefix, an empty one, one ending mid-block
PREFIX_IDS = [0, 2, -1, 0, 1, 2, 0, 2, -1]
SUFFIX_LENS = [3, 0, 40, 1, 17, 64, 9, 2, 0]  # the last one has neither prefix nor own tokens


def shared_args(kv, prefix_ids, prefix_lens, suffix_lens):
    return (kv.queries(len(prefix_ids)), kv.k_cache, kv.v_cache, torch.tensor(prefix_ids, dtype=torch.int32),
            kv.block_tables(prefix_lens), torch.tensor(prefix_lens, dtype=torch.int32), kv.block_tables(suffix_lens),
            torch.tensor(suffix_lens, dtype=torch.int32), kv.scale)


def test_decode_matches_reference(kernels, kv, tol):
    lens = torch.tensor(RAGGED, dtype=torch.int32)
    args = (kv.queries(len(RAGGED)), kv.k_cache, kv.v_cache, kv.block_tables(RAGGED), lens, kv.scale)

    out = kernels.decode(*args)

    torch.testing.assert_close(out, reference.paged_decode(*args), **tol)
    assert torch.all(out[3] == 0), "a row with no context must be zeros, not NaN"


def test_shared_prefix_decode_matches_reference(kernels, kv, tol):
    args = shared_args(kv, PREFIX_IDS, PREFIX_LENS, SUFFIX_LENS)

    out = kernels.shared_prefix_decode(*args)

    torch.testing.assert_close(out, reference.shared_prefix_decode(*args), **tol)
    assert torch.all(out[-1] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
@pytest.mark.parametrize("members", [40, 21, 16, 2])
def test_a_prefix_with_more_members_than_one_tile_holds(kernels, kv, tol, members):
    """Members past a tile's 96 query rows (32 sequences here) share the prefix in a second tile; with
    fewer tasks than two a thread (16 or 2 members, 3 kv heads, 2 threads) they split into tiles of
    equal size."""
    args = shared_args(kv, [0] * members, [150], [1 + i % 5 for i in range(members)])

    torch.testing.assert_close(kernels.shared_prefix_decode(*args), reference.shared_prefix_decode(*args), **tol)


@pytest.mark.parametrize("prefix_len", [21, 16, 5])
def test_a_few_members_over_a_short_prefix(kernels, kv, tol, prefix_len, two_threads):
    """4 members over a prefix shorter than a chunk, in 2 tiles of 6 query rows (3 kv heads, too few tasks for 2
    threads): the few-rows path that scores from keys turned into fp32 columns (bf16's widened), 16 tokens at
    a time, the prefix ending mid-group or on its edge."""
    args = shared_args(kv, [0] * 4, [prefix_len], [3, 1, 0, 2])

    torch.testing.assert_close(kernels.shared_prefix_decode(*args), reference.shared_prefix_decode(*args), **tol)


@pytest.mark.parametrize("members", [16, 2])
def test_a_long_prefix_split_by_tokens(kernels, kv, tol, members, two_threads):
    """Too few tasks for 2 threads and a prefix of 600 tokens: each tile's rows go over its two halves in two
    tasks, whose softmax states are merged; a member without own tokens among them."""
    args = shared_args(kv, [0] * members, [600], [i % 7 for i in range(members)])

    torch.testing.assert_close(kernels.shared_prefix_decode(*args), reference.shared_prefix_decode(*args), **tol)


def test_a_short_prefill_chunk_over_a_long_cache_split_by_tokens(kernels, kv, tol, two_threads):
    """10 new tokens over 500 cached: one tile of rows, 3 tasks for 2 threads, its cached blocks in two halves."""
    tables, cu, context = kv.block_tables([510]), torch.tensor([0, 10], dtype=torch.int32), torch.tensor([510], dtype=torch.int32)
    q = kv.queries(10)
    plan = cpu_attention.plan_prefill(tables, cu, context, kv.block_size, native_dtype=kv.k_cache.dtype)
    out = cpu_attention.prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale, plan=plan, native=kernels)
    torch.testing.assert_close(out, reference.paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale), **tol)


@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_runs_longer_than_a_segment(kernels, kv, tol):
    """The kernel's softmax moves once per 256-token segment: decodes over 600 and 257 tokens, and a prefill
    chunk of 300 tokens over 200 cached, whose tiles' nested runs and prefixes cross segment ends."""
    lens = torch.tensor([600, 257, 1], dtype=torch.int32)
    args = (kv.queries(3), kv.k_cache, kv.v_cache, kv.block_tables(lens.tolist()), lens, kv.scale)
    torch.testing.assert_close(kernels.decode(*args), reference.paged_decode(*args), **tol)

    tables, cu, context = kv.block_tables([500]), torch.tensor([0, 300], dtype=torch.int32), torch.tensor([500], dtype=torch.int32)
    q = kv.queries(300)
    plan = cpu_attention.plan_prefill(tables, cu, context, kv.block_size, native_dtype=kv.k_cache.dtype)
    out = cpu_attention.prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale, plan=plan, native=kernels)
    torch.testing.assert_close(out, reference.paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale), **tol)


@pytest.mark.parametrize("window", [1, 20, 64, 300])
def test_sliding_window_decode(kernels, kv, tol, window):
    """Each row over its last `window` tokens, its table starting at the window's block and the keys before its
    first masked (cpu_attention.windowed_decode_rows); the torch path's mask says the same."""
    lens = torch.tensor([600, 257, 37, 0, 64, 16], dtype=torch.int32)
    q, tables = kv.queries(len(lens)), kv.block_tables(lens.tolist())
    expected = reference.paged_decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale, window)

    rows = cpu_attention.windowed_decode_rows(tables, lens, window, kv.block_size)
    out = kernels.prepare_decode(rows.own_tables, rows.own_lens, firsts=rows.firsts)(q, kv.k_cache, kv.v_cache, kv.scale)

    torch.testing.assert_close(out, expected, **tol)
    assert torch.all(out[3] == 0)
    assert rows.own_lens[0] <= window + kv.block_size - 1, "the blocks before the window are not in the row's table"
    torch.testing.assert_close(cpu_attention.decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale, window=window),
                               expected, **tol)


@pytest.mark.parametrize("window", [7, 40, 260])
@pytest.mark.parametrize(("new", "cached"), [(300, 200), (10, 500), (33, 0)], ids=["segments", "split", "fresh"])
def test_sliding_window_prefill(kernels, kv, tol, window, new, cached, two_threads):
    """Prefill tiles under a window: a tile's prefix from its first query's window's block, each row masked from
    its own first key; across segment ends, a prefix split by tokens into two tasks, and a fresh prompt."""
    length = new + cached
    tables, cu = kv.block_tables([length]), torch.tensor([0, new], dtype=torch.int32)
    context, q = torch.tensor([length], dtype=torch.int32), kv.queries(new)
    expected = reference.paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale, window)
    for native_kernels in (kernels, None):
        out = cpu_attention.prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale, native=native_kernels,
                                    window=window)
        torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_peaked_scores(kernels, kv, tol):
    """Queries 30x as large: scores far apart, most weights deep in exp's underflow (bf16's exp clamps at
    2^-126 and scales by 2^n in one instruction), one or two tokens carrying a row; decodes and a prefill chunk."""
    lens = torch.tensor([300, 37, 129, 500], dtype=torch.int32)
    q = (kv.queries(4).float() * 30).to(kv.k_cache.dtype)
    args = (q, kv.k_cache, kv.v_cache, kv.block_tables(lens.tolist()), lens, kv.scale)
    torch.testing.assert_close(kernels.decode(*args), reference.paged_decode(*args), **tol)

    tables, cu, context = kv.block_tables([300]), torch.tensor([0, 100], dtype=torch.int32), torch.tensor([300], dtype=torch.int32)
    q = (kv.queries(100).float() * 30).to(kv.k_cache.dtype)
    plan = cpu_attention.plan_prefill(tables, cu, context, kv.block_size, native_dtype=kv.k_cache.dtype)
    out = cpu_attention.prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale, plan=plan, native=kernels)
    torch.testing.assert_close(out, reference.paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale), **tol)


@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_a_steps_rows_joined_in_one_call(kernels, kv, tol):
    """As the engine calls it: shared-prefix decodes, then two prefill chunks (one over a cached prefix), as one
    call over cpu_attention.join_rows' layout, equal to each part's reference."""
    prefix_ids, prefix_lens, suffix_lens = [0, 0, -1], [64], [3, 1, 40]
    shared = shared_args(kv, prefix_ids, prefix_lens, suffix_lens)
    q_lens, context = [70, 20], [70, 150]
    tables, context_lens = kv.block_tables(context), torch.tensor(context, dtype=torch.int32)
    cu = torch.tensor([0, 70, 90], dtype=torch.int32)
    prefill_q = kv.queries(sum(q_lens))
    plan = cpu_attention.plan_prefill(tables, cu, context_lens, kv.block_size, native_dtype=kv.k_cache.dtype)
    rows = cpu_attention.join_rows([cpu_attention.decode_rows(shared[6], shared[7], shared[3:6]),
                                    *(chunk.cached_rows for chunk in plan)], kv.block_size)
    prepared = kernels.prepare_decode(rows.own_tables, rows.own_lens, (rows.prefix_ids, rows.prefix_table, rows.prefix_len))

    out = prepared(torch.cat([shared[0], prefill_q]), kv.k_cache, kv.v_cache, kv.scale)

    torch.testing.assert_close(out[:3], reference.shared_prefix_decode(*shared), **tol)
    expected = reference.paged_prefill(prefill_q, kv.k_cache, kv.v_cache, tables, cu, context_lens, kv.scale)
    torch.testing.assert_close(out[3:], expected, **tol)


FORKS = 16


def forks_first_chunks(kv, shared_tokens: int, q_lens: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Tables and context lengths of forks of a prompt after their first chunks (q_lens new tokens each): the
    prompt's whole blocks (shared_tokens) in every table, then each fork's own copy of the prompt's last 4 tokens
    and its new ones."""
    shared_blocks = kv.block_tables([shared_tokens])[0]
    own = kv.block_tables([4 + n for n in q_lens])
    tables = torch.cat([shared_blocks.expand(len(q_lens), -1), own], dim=1)
    return tables, torch.tensor([shared_tokens + 4 + n for n in q_lens], dtype=torch.int32)


def joined_prefill(kernels, kv, tables, context, q_lens):
    """The chunks joined as the engine joins a step's (cpu_attention.join_rows), one kernel call; the rows and out."""
    cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32)
    q = kv.queries(sum(q_lens))
    plan = cpu_attention.plan_prefill(tables, cu, context, kv.block_size, native_dtype=kv.k_cache.dtype)
    rows = cpu_attention.join_rows([chunk.cached_rows for chunk in plan], kv.block_size)
    prepared = kernels.prepare_decode(rows.own_tables, rows.own_lens, (rows.prefix_ids, rows.prefix_table, rows.prefix_len))
    expected = reference.paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale)
    return rows, cu, prepared(q, kv.k_cache, kv.v_cache, kv.scale), expected


@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_forks_first_chunks_share_their_prompts_blocks(kernels, kv, tol):
    """As a step after 16 forks of a 100-token prompt: each fork's first chunk (1-4 new tokens) over the prompt's
    6 whole blocks, which all their tables share. join_rows gives the chunks one prefix (the kernel reads it once
    a tile of rows, not once a fork); a chunk whose 6 blocks only begin alike (its sixth its own) and another
    prompt's chunk keep theirs; every row equals the reference over its own table."""
    q_lens = [1 + i % 4 for i in range(FORKS)]
    forks, fork_context = forks_first_chunks(kv, 96, q_lens)
    alike = torch.cat([forks[0, :5], kv.block_tables([32])[0]])  # the prompt's first 5 blocks, then its own
    other = kv.block_tables([130])  # another prompt's 9 blocks
    tables = torch.cat([F.pad(forks, (0, 2), value=-1), F.pad(alike, (0, 2), value=-1)[None], other])
    context = torch.cat([fork_context, torch.tensor([102, 130], dtype=torch.int32)])
    q_lens += [2, 30]

    rows, cu, out, expected = joined_prefill(kernels, kv, tables, context, q_lens)

    forks_prefix = rows.prefix_ids[0].item()
    assert rows.prefix_ids[: cu[FORKS]].tolist() == [forks_prefix] * cu[FORKS].item(), "the forks' chunks share one prefix"
    assert rows.prefix_len[forks_prefix].item() == 96
    assert forks_prefix not in rows.prefix_ids[cu[FORKS] :].tolist(), "prefixes over other blocks stay apart"
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_forks_shared_prefix_split_by_tokens(kernels, kv, tol, two_threads):
    """4 forks' chunks of 2 tokens over 896 shared tokens: one tile of their rows, 3 tasks for 2 threads, so the
    shared prefix splits by tokens and the halves' softmax states merge over rows of several sequences."""
    tables, context = forks_first_chunks(kv, 896, [2] * 4)

    rows, _, out, expected = joined_prefill(kernels, kv, tables, context, [2] * 4)

    assert rows.prefix_ids.unique().numel() == 1
    torch.testing.assert_close(out, expected, **tol)


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_tiles_and_the_vector_path_agree(amx_tiles, kv, tol):
    """bf16 scores and weighted values on AMX tiles (16 rows a tile, the last padded): a 100-token prefill chunk
    over 300 cached tokens (tiles of 96 rows, a last of 12) and 16 forks' decodes over a shared prefix, equal
    to the references and to the vector path's within bf16's rounding."""
    tables, cu, context = kv.block_tables([400]), torch.tensor([0, 100], dtype=torch.int32), torch.tensor([400], dtype=torch.int32)
    q = kv.queries(100)
    plan = cpu_attention.plan_prefill(tables, cu, context, kv.block_size, native_dtype=kv.k_cache.dtype)
    shared = shared_args(kv, [0] * 16, [150], [1 + i % 5 for i in range(16)])
    outs = []
    for tiles in (True, False):
        assert amx_tiles.use_tiles(tiles) == tiles
        outs.append((cpu_attention.prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale, plan=plan,
                                           native=amx_tiles), amx_tiles.shared_prefix_decode(*shared)))
    (prefill, decode), (vector_prefill, vector_decode) = outs
    torch.testing.assert_close(prefill, reference.paged_prefill(q, kv.k_cache, kv.v_cache, tables, cu, context, kv.scale), **tol)
    torch.testing.assert_close(decode, reference.shared_prefix_decode(*shared), **tol)
    torch.testing.assert_close(prefill, vector_prefill, **tol)
    torch.testing.assert_close(decode, vector_decode, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(("num_heads", "num_kv_heads", "head_dim"), [(4, 4, 128), (16, 2, 64), (6, 3, 32)],
                         ids=["mha-d128", "gqa8-d64", "gqa2-d32"])
def test_other_head_layouts(kernels, dtype, num_heads, num_kv_heads, head_dim):
    torch.manual_seed(0)
    lens = [5, 90, 33]
    k_cache, v_cache = (torch.randn(32, 16, num_kv_heads, head_dim, dtype=dtype) for _ in range(2))
    tables = torch.randperm(32)[:21].view(3, 7).int()
    q = torch.randn(3, num_heads, head_dim, dtype=dtype)
    args = (q, k_cache, v_cache, tables, torch.tensor(lens, dtype=torch.int32), head_dim**-0.5)

    assert dispatch.native_decode(q, k_cache) is kernels
    torch.testing.assert_close(kernels.decode(*args), reference.paged_decode(*args),
                               **{"atol": 1e-4, "rtol": 1e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2})


def test_a_head_size_without_a_build_goes_to_the_torch_path(kernels):
    torch.manual_seed(0)
    k_cache, v_cache = (torch.randn(8, 16, 2, 40) for _ in range(2))
    q, tables, lens = torch.randn(2, 4, 40), torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), torch.tensor([20, 3], dtype=torch.int32)

    assert dispatch.native_decode(q, k_cache) is None
    out = dispatch.decode_attention(q, k_cache, v_cache, tables, lens, 40**-0.5)
    torch.testing.assert_close(out, reference.paged_decode(q, k_cache, v_cache, tables, lens, 40**-0.5))


@pytest.fixture
def fresh_library(monkeypatch, tmp_path):
    """library() looked up again, building into an empty cache; the process's own is restored after."""
    monkeypatch.setenv("PARROT_CACHE_DIR", str(tmp_path))
    native.library.cache_clear()
    yield
    native.library.cache_clear()


def test_switched_off_or_unbuildable_leaves_the_torch_paths(fresh_library, monkeypatch, caplog):
    monkeypatch.setenv(native.DISABLE_ENV, "0")
    assert native.library() is None
    native.library.cache_clear()

    monkeypatch.delenv(native.DISABLE_ENV)
    monkeypatch.setenv("CXX", "false")  # a "compiler" that fails every build
    with caplog.at_level(logging.WARNING, logger="kernels.native"):
        assert native.library() is None
    assert "torch paths" in caplog.text


@pytest.mark.slow  # builds the C++ kernels from scratch
def test_builds_once_into_the_cache(fresh_library, tmp_path):
    assert native.library() is not None
    built = list((tmp_path / "kernels").glob("*.so"))
    assert len(built) == 1 and not list((tmp_path / "kernels").glob("tmp*")), "one library, no scratch left"


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])
@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_write_kv_and_out_of_range_indices(kernels, kv):
    """Rows land at their slots (-1 skipped); a slot or block past the cache is refused, nothing read or written."""
    key, value = (torch.randn(3, kv.num_kv_heads, kv.head_dim, dtype=kv.k_cache.dtype) for _ in range(2))
    before = kv.k_cache.clone()
    assert kernels.write_kv(key, value, kv.k_cache, kv.v_cache, torch.tensor([5, -1, 40]))
    flat_k, flat_v = kv.k_cache.flatten(0, 1), kv.v_cache.flatten(0, 1)
    assert torch.equal(flat_k[5], key[0]) and torch.equal(flat_k[40], key[2]) and torch.equal(flat_v[40], value[2])
    assert torch.equal(flat_k[6:40], before.flatten(0, 1)[6:40])

    num_slots = kv.k_cache.shape[0] * kv.block_size
    with pytest.raises(IndexError, match="slot"):
        kernels.write_kv(key, value, kv.k_cache, kv.v_cache, torch.tensor([0, 1, num_slots]))
    tables = torch.tensor([[0, kv.k_cache.shape[0]]], dtype=torch.int32)
    with pytest.raises(IndexError, match="block"):
        kernels.decode(kv.queries(1), kv.k_cache, kv.v_cache, tables, torch.tensor([20], dtype=torch.int32), kv.scale)


@pytest.mark.parametrize("block_size", [16], ids=["page16"])
def test_views_of_one_fused_projection_read_in_place(kernels, kv, monkeypatch):
    """q, k and v as the model makes them (token-strided views of one qkv projection) are read where they are:
    no copy is made, and the cache and outputs equal those from contiguous copies."""
    heads, kv_heads, dim = kv.num_heads, kv.num_kv_heads, kv.head_dim
    fused = torch.randn(5, (heads + 2 * kv_heads) * dim).to(kv.k_cache.dtype)
    q, k, v = (part.view(5, -1, dim) for part in fused.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1))
    slots, lens = torch.arange(5) * 3, torch.tensor([1, 7, 30, 16, 2], dtype=torch.int32)
    tables = kv.block_tables(lens.tolist())
    expected_caches = (kv.k_cache.clone(), kv.v_cache.clone())
    kernels.write_kv(k.contiguous(), v.contiguous(), *expected_caches, slots)
    expected = kernels.decode(q.contiguous(), *expected_caches, tables, lens, kv.scale)
    contiguous = torch.Tensor.contiguous
    monkeypatch.setattr(torch.Tensor, "contiguous", lambda self, *a, **kw: pytest.fail("a copy of q, k or v was made")
                        if self.is_floating_point() else contiguous(self, *a, **kw))

    assert kernels.write_kv(k, v, kv.k_cache, kv.v_cache, slots)
    out = kernels.decode(q, kv.k_cache, kv.v_cache, tables, lens, kv.scale)

    assert torch.equal(kv.k_cache, expected_caches[0]) and torch.equal(kv.v_cache, expected_caches[1])
    assert torch.equal(out, expected)
