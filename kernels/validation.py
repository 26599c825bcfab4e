"""Argument checks run by every launcher before a kernel starts.

A Triton kernel given a wrong shape or dtype reads out of bounds or silently computes garbage,
so each launcher states its contract here and fails with a message naming the argument.
"""

from __future__ import annotations

import os

import torch

INDEX_DTYPES = (torch.int32, torch.int64)
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1, where kernels run on CPU tensors through numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def expect(
    tensor: torch.Tensor,
    name: str,
    *,
    ndim: int,
    dtypes: tuple[torch.dtype, ...],
    shape: dict[int, int] | None = None,
    contiguous: bool = False,
) -> None:
    """Raise ValueError unless `tensor` has `ndim` dims, one of `dtypes`, the sizes in `shape`
    (dim -> size) and a unit stride on its last dim (or full contiguity when asked)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tensor.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dims, got shape {tuple(tensor.shape)}")
    if tensor.dtype not in dtypes:
        allowed = ", ".join(str(d) for d in dtypes)
        raise ValueError(f"{name} must have dtype in ({allowed}), got {tensor.dtype}")
    for dim, size in (shape or {}).items():
        if tensor.shape[dim] != size:
            raise ValueError(f"{name}.shape[{dim}] must be {size}, got shape {tuple(tensor.shape)}")
    if contiguous and not tensor.is_contiguous():
        raise ValueError(f"{name} must be contiguous")
    if tensor.numel() and tensor.stride(-1) != 1:
        raise ValueError(f"{name} must have unit stride in its last dim, got strides {tensor.stride()}")


def expect_same_device(**tensors: torch.Tensor) -> None:
    first = next(iter(tensors.values())).device
    if any(t.device != first for t in tensors.values()):
        listing = ", ".join(f"{name}={t.device}" for name, t in tensors.items())
        raise ValueError(f"all tensors must be on one device, got {listing}")


def expect_triton_device(tensor: torch.Tensor) -> None:
    """Triton runs on CUDA tensors, or on CPU tensors under TRITON_INTERPRET=1."""
    if tensor.device.type != "cuda" and not interpreting():
        raise ValueError(f"Triton kernels need CUDA tensors (or TRITON_INTERPRET=1), got {tensor.device}")


def expect_kv_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Check the paged layout [num_blocks, block_size, num_kv_heads, head_dim]; return its sizes."""
    expect(k_cache, "k_cache", ndim=4, dtypes=FLOAT_DTYPES)
    expect(v_cache, "v_cache", ndim=4, dtypes=(k_cache.dtype,))
    if v_cache.shape != k_cache.shape:
        raise ValueError(f"v_cache's shape {tuple(v_cache.shape)} must equal k_cache's {tuple(k_cache.shape)}")
    if k_cache.stride() != v_cache.stride():
        raise ValueError(f"k_cache and v_cache must share strides, got {k_cache.stride()} and {v_cache.stride()}")
    num_blocks, block_size, num_kv_heads, head_dim = k_cache.shape
    return num_blocks, block_size, num_kv_heads, head_dim


def expect_gqa(num_heads: int, num_kv_heads: int) -> int:
    """Return the query heads per kv head, failing when the head counts do not divide."""
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})")
    return num_heads // num_kv_heads


def expect_query_and_cache(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> int:
    """q [rows, H, D] against the cache; return the GQA group size H // KVH."""
    expect(q, "q", ndim=3, dtypes=FLOAT_DTYPES)
    _, num_heads, head_dim = q.shape
    _, _, num_kv_heads, cache_head_dim = expect_kv_cache(k_cache, v_cache)
    if cache_head_dim != head_dim:
        raise ValueError(f"q head_dim {head_dim} != cache head_dim {cache_head_dim}")
    if q.dtype != k_cache.dtype:
        raise ValueError(f"q dtype {q.dtype} != cache dtype {k_cache.dtype}")
    return expect_gqa(num_heads, num_kv_heads)


def check_decode_args(q, k_cache, v_cache, block_tables, context_lens) -> int:
    """Validate a paged decode call; return the GQA group size."""
    group = expect_query_and_cache(q, k_cache, v_cache)
    batch = q.shape[0]
    expect(block_tables, "block_tables", ndim=2, dtypes=INDEX_DTYPES, shape={0: batch})
    expect(context_lens, "context_lens", ndim=1, dtypes=INDEX_DTYPES, shape={0: batch})
    expect_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables, context_lens=context_lens)
    return group


def check_prefill_args(q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens) -> int:
    """Validate a paged prefill call; return the GQA group size."""
    group = expect_query_and_cache(q, k_cache, v_cache)
    expect(context_lens, "context_lens", ndim=1, dtypes=INDEX_DTYPES)
    batch = context_lens.shape[0]
    expect(cu_seqlens_q, "cu_seqlens_q", ndim=1, dtypes=INDEX_DTYPES, shape={0: batch + 1})
    expect(block_tables, "block_tables", ndim=2, dtypes=INDEX_DTYPES, shape={0: batch})
    expect_same_device(q=q, k_cache=k_cache, v_cache=v_cache, block_tables=block_tables,
                       cu_seqlens_q=cu_seqlens_q, context_lens=context_lens)
    return group


def check_shared_prefix_args(
    q, k_cache, v_cache, prefix_ids, prefix_block_tables, prefix_lens, suffix_block_tables, suffix_lens
) -> int:
    """Validate a shared-prefix decode call; return the number of prefixes P."""
    check_decode_args(q, k_cache, v_cache, suffix_block_tables, suffix_lens)
    expect(prefix_ids, "prefix_ids", ndim=1, dtypes=INDEX_DTYPES, shape={0: q.shape[0]})
    expect(prefix_block_tables, "prefix_block_tables", ndim=2, dtypes=INDEX_DTYPES)
    num_prefixes = prefix_block_tables.shape[0]
    expect(prefix_lens, "prefix_lens", ndim=1, dtypes=INDEX_DTYPES, shape={0: num_prefixes})
    expect_same_device(q=q, prefix_ids=prefix_ids, prefix_block_tables=prefix_block_tables, prefix_lens=prefix_lens)
    return num_prefixes


def check_kv_write_args(key, value, k_cache, v_cache, slot_mapping) -> None:
    _, _, num_kv_heads, head_dim = expect_kv_cache(k_cache, v_cache)
    expect(key, "key", ndim=3, dtypes=FLOAT_DTYPES, shape={1: num_kv_heads, 2: head_dim})
    expect(value, "value", ndim=3, dtypes=FLOAT_DTYPES, shape=dict(enumerate(key.shape)))
    expect(slot_mapping, "slot_mapping", ndim=1, dtypes=INDEX_DTYPES, shape={0: key.shape[0]})
    expect_same_device(key=key, value=value, k_cache=k_cache, v_cache=v_cache, slot_mapping=slot_mapping)
