"""Attention and KV-cache kernels for the builtin engine; the engine calls `kernels.dispatch`.

Triton is optional: importing this package or the dispatch module does not import it, and CPU
tensors never need it.
"""

from kernels.dispatch import decode_attention, prefill_attention, shared_prefix_decode_attention, write_kv

__all__ = ["decode_attention", "prefill_attention", "shared_prefix_decode_attention", "write_kv"]
