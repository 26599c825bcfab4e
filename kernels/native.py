"""The CPU kernels written in C++ (kernels/native/*.cpp, one library), built on first use and called through ctypes.

They include no torch headers, so the system compiler builds them quickly (no ninja, no
extension toolchain). The one exception is native/torch_ops.cpp, the linears and a compiled forward's attention as
torch operators with C++ bodies, built apart with torch's headers (``torch_ops()``, a much slower build, once) so
that a call skips Python. Each
library is cached per source, flags and compiler under
``$PARROT_CACHE_DIR`` (default ``~/.cache/parrot``; keyed by source, flags, compiler and CPU) and written atomically, so engine processes
started together build it once each at most and never load a half-written file. Where no compiler
is found (``$CXX``, else ``c++`` / ``g++`` / ``clang++``) or the build fails, ``library()`` is None
and dispatch keeps the torch paths (one warning says why); ``PARROT_NATIVE_KERNELS=0`` asks for that.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from pathlib import Path
from typing import NamedTuple

import torch

log = logging.getLogger(__name__)

SOURCES = tuple(Path(__file__).parent / "native" / name
                for name in ("paged_attention.cpp", "linear.cpp", "affinity.cpp", "argmax.cpp", "greedy_head.cpp"))
# Included by the sources: part of the build's key.
HEADERS = tuple(Path(__file__).parent / "native" / name for name in ("common.h", "c_api.h"))
# The linear and attention kernels again, with torch operators over them (torch_ops()): built apart, with torch's headers.
TORCH_OPS_SOURCES = tuple(Path(__file__).parent / "native" / name
                          for name in ("torch_ops.cpp", "linear.cpp", "paged_attention.cpp"))
FLAGS = ("-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", "-std=c++17")
DISABLE_ENV = "PARROT_NATIVE_KERNELS"

_INT, _I64, _PTR = ctypes.c_int, ctypes.c_int64, ctypes.c_void_p
_DECODE_ARGS = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _I64, _PTR, _I64, _PTR, _PTR, _PTR,
                _I64, _I64, _I64, _I64, _I64, _I64, ctypes.c_float, _I64, _INT]
_WRITE_ARGS = [_PTR, _PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _I64, _I64]
_LINEAR_ARGS = [_PTR, _PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]
_GATED_ARGS = [_PTR, _PTR, _PTR, _I64, _I64, _I64, _INT]
_SCREENED_ARGMAX_ARGS = [_PTR, _I64, _I64, _PTR, _PTR, _PTR, _PTR, _I64, _PTR, _INT]
_SUFFIXES = {torch.float32: "f32", torch.bfloat16: "bf16"}
HEAD_DIMS = (32, 64, 80, 96, 128, 256)
MAX_GROUP = 96  # the kernel's kTileRows: query heads a kv head it takes
LINEAR_BLOCK = 32  # native/linear.cpp's block of output features
LINEAR_PACK = {torch.float32: 1, torch.bfloat16: 2}  # inputs a step takes: the packed weight's last dimension
GROUP_INPUTS = 32  # native/c_api.h's kGroupInputs: inputs a group-quantized weight's scale (and minimum) cover
# native/c_api.h's kQ4BlockBytesPerInput and kQ8BlockBytesPerInput: a packed block's bytes per input, by format
GROUPED_BLOCK_BYTES_PER_INPUT = {"q4": 20, "q8": 34}
MAX_SCREENED_ROWS = 16  # native/greedy_head.cpp's kMaxScreenedRows
SCREEN_CHUNK_BLOCKS = 128  # head_screen()'s blocks at a time (19 MB of float64 at SmolLM2's 576 inputs)


class NativeKernels:
    """The loaded library's entry points, with dispatch.decode_attention's and
    dispatch.shared_prefix_decode_attention's contracts (or prepared once for a step's layers), and the
    linear layers."""

    def __init__(self, library: ctypes.CDLL):
        self._decode, self._write, self._linear, self._gated = {}, {}, {}, {}
        for dtype, suffix in _SUFFIXES.items():
            self._decode[dtype] = _bound(library, f"parrot_decode_{suffix}", _DECODE_ARGS, _INT)
            self._write[dtype] = _bound(library, f"parrot_write_kv_{suffix}", _WRITE_ARGS, _INT)
            self._linear[dtype] = _bound(library, f"parrot_linear_{suffix}", _LINEAR_ARGS, _INT)
            self._gated[dtype] = _bound(library, f"parrot_gated_linear_{suffix}", _GATED_ARGS, _INT)
        self._pin_threads = _bound(library, "parrot_pin_threads", [_PTR, _INT], _INT)
        # Absent from a library built from older sources (benchmarks.kernel_revisions' "before" build).
        self._argmax = (_bound(library, "parrot_argmax_rows_f32", [_PTR, _I64, _I64, _I64, _PTR, _INT], _INT)
                        if hasattr(library, "parrot_argmax_rows_f32") else None)
        self._screened_argmax = {dtype: _bound(library, f"parrot_screened_argmax_{suffix}", _SCREENED_ARGMAX_ARGS, _INT)
                                 for dtype, suffix in _SUFFIXES.items()
                                 if hasattr(library, f"parrot_screened_argmax_{suffix}")}
        self._use_tiles = _bound(library, "parrot_use_tiles", [_INT], _INT)
        # Absent from a library built from older sources; -2 from all four where the build has no AVX2, F16C and FMA.
        self._pack = {format: _bound(library, f"parrot_pack_{format}", [_PTR, _PTR, _PTR, _PTR, _I64, _I64], _INT)
                      for format in GROUPED_BLOCK_BYTES_PER_INPUT if hasattr(library, f"parrot_pack_{format}")}
        self.has_grouped = (len(self._pack) == len(GROUPED_BLOCK_BYTES_PER_INPUT)
                            and all(self._probe_grouped(library, format) for format in self._pack))
        # Built without a bf16 dot product (another CPU or compiler), the bf16 linear answers -2.
        probe = torch.zeros(LINEAR_BLOCK, 2, dtype=torch.bfloat16)
        self._linear_dtypes = {dtype for dtype in self._linear
                               if self._run_linear(probe[:1].to(dtype), pack_linear(probe.to(dtype)), None, LINEAR_BLOCK, 2)[0] == 0}

    def supports(self, dtype: torch.dtype, head_dim: int, query_group: int) -> bool:
        return dtype in self._decode and head_dim in HEAD_DIMS and query_group <= MAX_GROUP

    def supports_linear(self, weight: torch.Tensor) -> bool:
        """Whether linear() takes this weight (its dtype, and sizes multiples of the kernel's tiles)."""
        out_features, in_features = weight.shape
        return (weight.dtype in self._linear_dtypes and out_features % LINEAR_BLOCK == 0
                and in_features % LINEAR_PACK[weight.dtype] == 0)

    def linear(self, x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        """x [rows, in] @ weight.T + bias, in x's dtype, the weight as pack_linear() lays it out (see
        native/linear.cpp). Shapes and dtypes are checked here: the kernel reads what the pointers say."""
        out_features, in_features = self._checked_linear(x, packed, bias)
        status, out = self._run_linear(x.contiguous(), packed, None if bias is None else bias.contiguous(),
                                       out_features, in_features)
        if status != 0:
            raise ValueError(f"the native linear refused x {tuple(x.shape)} with a weight of {out_features}x{in_features}")
        return out

    def gated_linear(self, x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        """silu(x @ gate.T) * (x @ up.T) [rows, I], the [2I, in] gate-and-up weight as pack_gated_linear() lays
        it out, rounded where torch's unfused ops round (see native/linear.cpp)."""
        out_features, in_features = self._checked_linear(x, packed, None)
        x = x.contiguous()  # held by a name: a temporary's memory would be freed before the kernel reads it
        rows = x.shape[0]
        out = x.new_empty(rows, out_features // 2)
        # An odd count of blocks (not gate and up pairs) leaves half the features off the blocks: refused there.
        status = self._gated[x.dtype](x.data_ptr(), packed.data_ptr(), out.data_ptr(), rows, out_features // 2,
                                      in_features, torch.get_num_threads())
        if status != 0:
            raise ValueError(f"the native gated linear refused x {tuple(x.shape)} with a weight of {out_features}x{in_features}")
        return out

    def _checked_linear(self, x, packed, bias) -> tuple[int, int]:
        """(out_features, in_features) of ``packed``, or ValueError where x, it and bias do not go together.
        Each tensor's shape is read once: a decode step makes 120 of these calls, and this check was a
        fifth of a call's own cost."""
        shape, dtype = packed.shape, packed.dtype
        blocked = (len(shape) == 4 and shape[2] == LINEAR_BLOCK and shape[3] == LINEAR_PACK.get(dtype)
                   and dtype in self._linear_dtypes and packed.is_contiguous())
        out_features, in_features = (shape[0] * shape[2], shape[1] * shape[3]) if blocked else (0, 0)
        x_shape = x.shape
        if not (blocked and len(x_shape) == 2 and x_shape[1] == in_features and x.dtype == dtype
                and (bias is None or (bias.dtype == dtype and bias.shape == (out_features,)))):
            raise ValueError(f"the native linear does not take x {tuple(x.shape)} {x.dtype}, packed weight "
                             f"{tuple(packed.shape)} {packed.dtype}, bias {None if bias is None else (tuple(bias.shape), bias.dtype)}")
        return out_features, in_features

    def _run_linear(self, x, packed, bias, out_features: int, in_features: int) -> tuple[int, torch.Tensor]:
        rows = x.shape[0]
        out = x.new_empty(rows, out_features)
        status = self._linear[x.dtype](x.data_ptr(), packed.data_ptr(), None if bias is None else bias.data_ptr(),
                                       out.data_ptr(), rows, out_features, in_features, torch.get_num_threads())
        return status, out

    def _probe_grouped(self, library: ctypes.CDLL, format: str) -> bool:
        """Whether this build has the group-quantized ``format`` kernel (it answers -2 where not built, and the
        engine keeps torch's kernels). Every tensor is held by a name while the kernels read it."""
        pack, run = self._pack[format], _bound(library, f"parrot_linear_{format}", _LINEAR_ARGS, _INT)
        codes, scales = torch.zeros(LINEAR_BLOCK, GROUP_INPUTS, dtype=torch.uint8), torch.zeros(LINEAR_BLOCK, 1)
        packed = torch.empty(1, GROUPED_BLOCK_BYTES_PER_INPUT[format] * GROUP_INPUTS, dtype=torch.uint8)
        x, out = torch.zeros(1, GROUP_INPUTS), torch.empty(1, LINEAR_BLOCK)
        return (pack(codes.data_ptr(), scales.data_ptr(), scales.data_ptr(), packed.data_ptr(), LINEAR_BLOCK,
                     GROUP_INPUTS) == 0
                and run(x.data_ptr(), packed.data_ptr(), None, out.data_ptr(), 1, LINEAR_BLOCK, GROUP_INPUTS, 1) == 0)

    def takes_grouped(self, out_features: int, in_features: int) -> bool:
        """Whether the group-quantized kernels serve here and take a weight of these sizes (whole groups of inputs,
        whole blocks of output features)."""
        return self.has_grouped and out_features % LINEAR_BLOCK == 0 and in_features % GROUP_INPUTS == 0

    def pack_q4(self, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor) -> torch.Tensor:
        """A 4-bit weight (GGUF's Q4_1) as parrot_native::linear_q4 reads it (native/linear.cpp's layout) from codes
        [N, K] (0-15) and each group of GROUP_INPUTS inputs' scales and minimums [N, K / GROUP_INPUTS] (kept as fp16)."""
        return self._pack_grouped("q4", codes.to(torch.uint8), scales, minimums)

    def pack_q8(self, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """An 8-bit weight (GGUF's Q8_0) as parrot_native::linear_q8 reads it from codes [N, K] (int8, -127..127)
        and each group of GROUP_INPUTS inputs' scales [N, K / GROUP_INPUTS] (kept as fp16)."""
        if codes.dtype != torch.int8 or codes.eq(-128).any():
            raise ValueError("8-bit codes are int8 from -127 to 127 (the kernel negates them)")
        return self._pack_grouped("q8", codes.view(torch.uint8), scales)

    def _pack_grouped(self, format: str, codes, scales, minimums=None) -> torch.Tensor:
        out_features, in_features = codes.shape
        if (not self.takes_grouped(out_features, in_features)
                or scales.shape != (out_features, in_features // GROUP_INPUTS)
                or (minimums is not None and minimums.shape != scales.shape)):
            raise ValueError(f"the group-quantized kernel does not take codes {tuple(codes.shape)}, scales "
                             f"{tuple(scales.shape)}" + ("" if self.has_grouped else " (not built here: it needs AVX2, F16C and FMA)"))
        codes = codes.contiguous()
        scales = scales.float().contiguous()
        minimums = None if minimums is None else minimums.float().contiguous()
        packed = torch.empty(out_features // LINEAR_BLOCK, GROUPED_BLOCK_BYTES_PER_INPUT[format] * in_features,
                             dtype=torch.uint8)
        if self._pack[format](codes.data_ptr(), scales.data_ptr(), None if minimums is None else minimums.data_ptr(), packed.data_ptr(),
                out_features, in_features):
            raise ValueError(f"the group-quantized kernel refused codes {tuple(codes.shape)}")
        return packed

    def argmax_rows(self, logits: torch.Tensor) -> list[int] | None:
        """Each row's argmax of fp32 [rows, cols] logits, as torch.argmax(dim=-1) answers it (the first maximum,
        a NaN above any number), several times faster than torch's (native/argmax.cpp); None where the tensor is
        not one it takes (another device, dtype or layout, no columns): the caller keeps torch's."""
        if (self._argmax is None or logits.device.type != "cpu" or logits.dtype != torch.float32 or logits.dim() != 2
                or logits.stride(1) != 1 or logits.shape[1] == 0):
            return None
        rows, cols = logits.shape
        row_stride = logits.stride(0) if rows > 1 else cols  # one row's stride(0) can be anything
        out = torch.empty(rows, dtype=torch.int64)
        if self._argmax(logits.data_ptr(), rows, cols, row_stride, out.data_ptr(), torch.get_num_threads()) != 0:
            return None
        return out.tolist()

    def screened_argmax(self, x: torch.Tensor, packed_head: torch.Tensor, screen: HeadScreen) -> list[int] | None:
        """Each row's argmax of x [rows, K] @ head.T, the head packed by pack_linear(), as argmax_rows() answers it
        over linear()'s logits, reading the head's int8 screen and a few of its blocks instead of all of it
        (native/greedy_head.cpp). None where it does not answer: sizes or dtypes it does not take, more than
        MAX_SCREENED_ROWS rows, an input or bound that is not finite, a NaN among the candidates' logits, more
        candidates than the full head would cost."""
        vocab, in_features = linear_shape(packed_head)
        run = self._screened_argmax.get(x.dtype)
        if (run is None or x.dtype not in self._linear_dtypes or packed_head.dtype != x.dtype or x.dim() != 2
                or not x.is_contiguous() or x.shape[1] != in_features or not 1 <= x.shape[0] <= MAX_SCREENED_ROWS
                or screen.codes.shape != (vocab // LINEAR_BLOCK, in_features // 2, LINEAR_BLOCK, 2)):
            return None
        tokens = torch.empty(x.shape[0], dtype=torch.int64)
        status = run(x.data_ptr(), x.shape[0], in_features, packed_head.data_ptr(), screen.codes.data_ptr(),
                     screen.scales.data_ptr(), screen.radii.data_ptr(), vocab, tokens.data_ptr(), torch.get_num_threads())
        return tokens.tolist() if status == 0 else None

    def use_tiles(self, enable: bool) -> bool:
        """Whether bf16 linears and attention products run on AMX tiles (the default where the CPU has them) or
        on the vector paths from now on; answers whether tiles are in use. For comparing the two paths."""
        return bool(self._use_tiles(int(enable)))

    def pin_threads(self, cores: tuple[int, ...]) -> int:
        """The calling thread's OpenMP team (torch's intra-op threads) one thread to a core, thread i on
        cores[i]: native/affinity.cpp's status (0: pinned)."""
        return self._pin_threads((ctypes.c_int32 * len(cores))(*cores), len(cores))

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> bool:
        """dispatch.write_kv's contract; False (nothing written) where these tensors are not for it."""
        return self.prepare_kv_write(slot_mapping)(key, value, k_cache, v_cache)

    def decode(self, q, k_cache, v_cache, block_tables, context_lens, scale: float) -> torch.Tensor:
        return self.prepare_decode(block_tables, context_lens)(q, k_cache, v_cache, scale)

    def shared_prefix_decode(self, q, k_cache, v_cache, prefix_ids, prefix_block_tables, prefix_lens,
                             suffix_block_tables, suffix_lens, scale: float) -> torch.Tensor:
        prepared = self.prepare_decode(suffix_block_tables, suffix_lens, (prefix_ids, prefix_block_tables, prefix_lens))
        return prepared(q, k_cache, v_cache, scale)

    def prepare_kv_write(self, slot_mapping: torch.Tensor) -> PreparedKvWrite:
        return PreparedKvWrite(self, slot_mapping)

    def prepare_decode(self, own_tables: torch.Tensor, own_lens: torch.Tensor,
                       prefixes: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
                       firsts: torch.Tensor | None = None) -> PreparedDecode:
        """A step's decode for each of its layers (see PreparedDecode): own_tables [B, blocks] and own_lens [B]
        int32; prefixes (prefix_ids [B], prefix_tables [P, blocks], prefix_lens [P]) int32, or None; firsts [B]
        int32, each row's first visible key under a sliding window counted from its prefix's first token (its
        own run's without one; cpu_attention.NativeRows), or None: every key."""
        return PreparedDecode(self, own_tables, own_lens, prefixes, firsts)


def _int32_rows(tensor: torch.Tensor, name: str, ndim: int, rows: int | None = None) -> torch.Tensor:
    """tensor as the kernels read it (contiguous int32 with `ndim` dims and `rows` rows), or ValueError."""
    if not (isinstance(tensor, torch.Tensor) and tensor.dtype == torch.int32 and tensor.dim() == ndim
            and tensor.device.type == "cpu" and (rows is None or tensor.shape[0] == rows)):
        raise ValueError(f"{name} must be a CPU int32 tensor with {ndim} dims" + (f" and {rows} rows" if rows else "")
                         + f", got {getattr(tensor, 'dtype', type(tensor))} {tuple(getattr(tensor, 'shape', ()))}")
    return tensor.contiguous()


class PreparedDecode:
    """One step's decode attention on the C++ kernel, for each of its layers.

    The step's block tables, lengths and shared prefixes are checked and made into the kernel's arguments
    once: checking and converting them again in each of 30 layer calls cost more than a batch-1 decode's
    own work (docs/engine.md, "Measurements behind design choices"). A layer's query and caches are checked in
    full the first time their shapes are seen, then only compared with those.
    """

    def __init__(self, kernels: NativeKernels, own_tables, own_lens, prefixes=None, firsts=None):
        own_tables = _int32_rows(own_tables, "block_tables", 2)
        own_lens = _int32_rows(own_lens, "context_lens", 1, own_tables.shape[0])
        self.batch = own_tables.shape[0]
        prefix_args = (None, None, 0, None, 0)  # null prefix ids: no sequence has one, no prefix table is read
        self.prefixes = (None, None, None)
        if prefixes is not None:
            ids = _int32_rows(prefixes[0], "prefix_ids", 1, self.batch)
            tables = _int32_rows(prefixes[1], "prefix_block_tables", 2)
            lens = _int32_rows(prefixes[2], "prefix_lens", 1, tables.shape[0])
            self.prefixes = (ids, tables, lens)
            prefix_args = (ids.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(), len(lens))
        self.firsts = None if firsts is None else _int32_rows(firsts, "firsts", 1, self.batch)
        # Held: the kernel reads them by pointer (and torch_ops' set_step takes them as tensors).
        self._kernels, self.own_tables, self.own_lens = kernels, own_tables, own_lens
        self._table_args = (*prefix_args, own_tables.data_ptr(), own_tables.stride(0), own_lens.data_ptr(),
                            None if self.firsts is None else self.firsts.data_ptr())
        self._fits: tuple | None = None  # the (query, cache) shapes and dtype already checked

    @property
    def tables(self) -> tuple:
        """own_tables, own_lens, prefix_ids, prefix_tables, prefix_lens (the last three None without prefixes), as
        torch_ops' set_step takes them."""
        return (self.own_tables, self.own_lens, *self.prefixes)

    def __call__(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, scale: float) -> torch.Tensor:
        shapes = (q.shape, q.dtype, k_cache.shape, v_cache.shape, v_cache.dtype)
        if shapes != self._fits:
            self._check(q, k_cache, v_cache)
            self._fits = shapes
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the native decode reads contiguous caches")
        q = _token_rows(q)
        out = q.new_empty(q.shape)
        _, num_heads, head_dim = q.shape
        num_blocks, block_size, num_kv_heads, _ = k_cache.shape
        status = self._kernels._decode[q.dtype](
            q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), *self._table_args, out.data_ptr(), self.batch,
            num_heads, num_kv_heads, head_dim, block_size, num_blocks, scale, q.stride(0), torch.get_num_threads(),
        )
        if status == -2:
            raise IndexError(f"a block table names a block past the cache's {num_blocks} blocks")
        if status != 0:
            raise ValueError(f"the native decode kernel does not take head_dim {head_dim} with {num_heads} heads")
        return out

    def _check(self, q, k_cache, v_cache) -> None:
        fits = (q.dim() == 3 and q.shape[0] == self.batch and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
                and q.dtype == k_cache.dtype == v_cache.dtype and q.device.type == k_cache.device.type == "cpu"
                and q.shape[2] == k_cache.shape[3] and q.shape[1] % k_cache.shape[2] == 0
                and self._kernels.supports(q.dtype, q.shape[2], q.shape[1] // k_cache.shape[2]))
        if not fits:
            raise ValueError(f"the native decode does not take q {tuple(q.shape)} {q.dtype} for {self.batch} sequences "
                             f"over caches {tuple(k_cache.shape)} {k_cache.dtype} / {tuple(v_cache.shape)} {v_cache.dtype}")


class PreparedKvWrite:
    """One step's KV writes on the C++ kernel, for each of its layers: the slots made into the kernel's
    argument once (see PreparedDecode); a layer's keys and caches checked in full the first time their
    shapes are seen. Calls answer False (nothing written) where the tensors are not for the kernel."""

    def __init__(self, kernels: NativeKernels, slot_mapping: torch.Tensor):
        self._functions = kernels._write
        self.slots = slot_mapping.long().contiguous()  # held: the kernel reads it by pointer (torch_ops' set_step too)
        self._fits: tuple | None = None

    def __call__(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
        shapes = (key.shape, key.dtype, value.shape, value.dtype, k_cache.shape, k_cache.dtype, v_cache.shape, v_cache.dtype)
        if shapes != self._fits:
            if not self._takes(key, value, k_cache, v_cache):
                return False
            self._fits = shapes
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            return False
        key, value = _token_rows(key), _token_rows(value)
        row_elems = k_cache.shape[2] * k_cache.shape[3]
        status = self._functions[key.dtype](key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
                                            self.slots.data_ptr(), len(self.slots), row_elems,
                                            k_cache.shape[0] * k_cache.shape[1], key.stride(0), value.stride(0))
        if status != 0:
            raise IndexError(f"a slot in slot_mapping is past the cache's {k_cache.shape[0] * k_cache.shape[1]} slots")
        return True

    def _takes(self, key, value, k_cache, v_cache) -> bool:
        return (key.dtype == value.dtype == k_cache.dtype == v_cache.dtype and key.dtype in self._functions
                and key.device.type == value.device.type == k_cache.device.type == v_cache.device.type == "cpu"
                and k_cache.dim() == 4 and v_cache.shape == k_cache.shape
                and key.shape == value.shape == (len(self.slots), *k_cache.shape[2:]))


def _token_rows(x: torch.Tensor) -> torch.Tensor:
    """[tokens, heads, D] with each token's heads contiguous, as the kernels read it (any token stride: q, k and
    v are views of one fused projection, and copying them cost three copies a layer), else a contiguous copy."""
    return x if x.stride(2) == 1 and x.stride(1) == x.shape[2] else x.contiguous()


def pack_linear(weight: torch.Tensor) -> torch.Tensor:
    """A [N, K] weight blocked for native/linear.cpp: [N/32, K/P, 32, P], P inputs a step (LINEAR_PACK)."""
    out_features, in_features = weight.shape
    pack = LINEAR_PACK[weight.dtype]
    blocks = weight.reshape(out_features // LINEAR_BLOCK, LINEAR_BLOCK, in_features // pack, pack)
    return blocks.transpose(1, 2).contiguous()


def pack_gated_linear(weight: torch.Tensor) -> torch.Tensor:
    """A [2I, K] gate-and-up weight (gate rows first) packed for native/linear.cpp's gated linear: its blocks of 32
    output features alternate, gate block j then up block j (I a multiple of 32)."""
    halves = weight.reshape(2, weight.shape[0] // (2 * LINEAR_BLOCK), LINEAR_BLOCK, weight.shape[1])
    return pack_linear(halves.transpose(0, 1).reshape(weight.shape))


class HeadScreen(NamedTuple):
    """An output head's int8 copy for native/greedy_head.cpp: each vocabulary row n in codes of scale scales[n],
    blocked as pack_linear() blocks a bf16 weight, in pairs of inputs ([N/32, K/2, 32, 2]), and radii[n]: how far the
    row's approximate logit scales[n] * (codes_n . x) may lie from the exact one computed by the linear kernel, per
    unit of |x|_1 (the kernel adds what rounding x to integers may add)."""
    codes: torch.Tensor
    scales: torch.Tensor
    radii: torch.Tensor


def head_screen(packed_head: torch.Tensor) -> HeadScreen | None:
    """The screen of an fp32 or bf16 head packed by pack_linear(), or None for a weight that is not finite or an odd
    number of inputs. Made SCREEN_CHUNK_BLOCKS blocks at a time: in float64 at once SmolLM2's head took ~1 GB of
    temporaries, a 128k x 4,096 head ~15 GB."""
    vocab, in_features = linear_shape(packed_head)
    if in_features % 2:
        return None
    codes = torch.empty(vocab, in_features, dtype=torch.int8)
    scales, radii = torch.empty(vocab), torch.empty(vocab)
    for block in range(0, vocab // LINEAR_BLOCK, SCREEN_CHUNK_BLOCKS):
        part = packed_head[block : block + SCREEN_CHUNK_BLOCKS].detach().transpose(1, 2).reshape(-1, in_features)
        rows = slice(block * LINEAR_BLOCK, block * LINEAR_BLOCK + part.shape[0])
        if not _screen_rows(part.to(torch.float64), codes[rows], scales[rows], radii[rows]):
            return None
    blocked = codes.reshape(vocab // LINEAR_BLOCK, LINEAR_BLOCK, in_features // 2, 2).transpose(1, 2)
    return HeadScreen(blocked.contiguous(), scales, radii)


def _screen_rows(w: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, radii: torch.Tensor) -> bool:
    """Codes, scales and radii of a head's [rows, K] float64 rows, written into the given views; False for a weight
    that is not finite.

    A row's radius bounds, per unit of |x|_1 (each |w_k x_k| <= max|w| |x_k|), how far the exact logit as the linear
    kernel computes it can be from scale * (codes . x):
    - the row's quantisation error, max_k |w_k - scale * code_k| (exactly, in float64);
    - the fp32 rounding of the exact logit's sum: within gamma_n of the sum of the terms' magnitudes, n the additions
      along a chain, taken as 2K + 16 for bf16's pairs and the kernels' unrolled sums;
    widened by 2^-10 and rounded up to fp32. The screen's own sums are integers (exact); the kernel adds what rounding
    x to integers and its fp32 products may add. An all-zero row has scale 0 and radius 0: its logit is 0 exactly."""
    if not torch.isfinite(w).all():
        return False
    largest = w.abs().amax(dim=1)
    scales.copy_(largest / 127)
    divisor = torch.where(scales > 0, scales, 1.0).to(torch.float64)[:, None]
    rounded = (w / divisor).round_().clamp_(-127, 127)
    codes.copy_(rounded)
    error = rounded.mul_(divisor).sub_(w).abs_().amax(dim=1)
    chain = 2 * w.shape[1] + 16
    gamma = chain * 2.0**-24 / (1 - chain * 2.0**-24)
    radii.copy_((error + gamma * largest) * (1 + 2.0**-10))
    radii.copy_(torch.nextafter(radii, torch.tensor(float("inf"))))
    return True


def linear_shape(packed: torch.Tensor) -> tuple[int, int]:
    """(out_features, in_features) of a weight packed by pack_linear()."""
    blocks, steps, block, pack = packed.shape
    return blocks * block, steps * pack


def _bound(library: ctypes.CDLL, symbol: str, argtypes: list, restype):
    function = getattr(library, symbol)
    function.argtypes, function.restype = argtypes, restype
    return function


@functools.cache
def library() -> NativeKernels | None:
    """The built kernels, or None where they cannot be built here (or are switched off)."""
    if os.environ.get(DISABLE_ENV, "1") == "0":
        return None
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler found ($CXX, c++, g++, clang++): the CPU kernels stay on the torch paths")
        return None
    try:
        return NativeKernels(ctypes.CDLL(str(_built(compiler))))
    except (OSError, subprocess.CalledProcessError) as exc:
        log.warning("building the native CPU kernels failed, the CPU kernels stay on the torch paths: %s", exc)
        return None


def has_compiler() -> bool:
    """Whether a C++ compiler is found: these kernels' builds need one, and so does torch.compile's CPU code."""
    return _compiler() is not None


def _compiler() -> str | None:
    candidates = [os.environ["CXX"]] if os.environ.get("CXX") else ["c++", "g++", "clang++"]
    return next((path for path in map(shutil.which, candidates) if path), None)


def _cpu_signature() -> str:
    """What -march=native builds for: a cache shared by machines with other CPUs must not hand them this build."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            return next((line for line in cpuinfo if line.startswith(("flags", "Features"))), platform.machine())
    except OSError:
        return platform.machine() + platform.processor()


def _built(compiler: str, sources=SOURCES, name: str = "parrot_kernels", flags: tuple[str, ...] = (),
           keyed_by: tuple[str, ...] = ()) -> Path:
    """The library of ``sources`` (built with FLAGS and ``flags``) from the cache, built there first if missing;
    ``keyed_by``: what else the build depends on."""
    version = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=True).stdout
    parts = [*(source.read_text() for source in (*sources, *HEADERS)), *FLAGS, *flags, *keyed_by, compiler, version,
             _cpu_signature()]
    key = hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]
    cache = Path(os.environ.get("PARROT_CACHE_DIR") or Path.home() / ".cache" / "parrot") / "kernels"
    target = cache / f"{name}-{key}.so"
    if not target.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as scratch:
            built = Path(scratch) / target.name
            compile_sources(compiler, sources, built, flags)
            os.replace(built, target)
    return target


# The namespaces of the torch operators Parrot defines (kernels/, engines/builtin/compiled_model.py).
OPERATOR_NAMESPACES = ("parrot", "parrot_native")


def operators_cache_tag() -> str:
    """A tag for torch.compile's on-disk caches: the schemas of Parrot's operators. Inductor keys a cached graph by
    its own code, not by the schemas of the custom operators that code calls: after an operator lost an argument
    it served a graph compiled before, whose first call then failed."""
    names = sorted(name for name in torch._C._dispatch_get_all_op_names() if name.split("::")[0] in OPERATOR_NAMESPACES)
    schemas = "\n".join(str(schema) for name in names for schema in torch._C._jit_get_schemas_for_operator(name))
    return "parrot-operators-" + hashlib.sha256(schemas.encode()).hexdigest()[:16]


def keyed_by_operators():
    """torch.compile's setting that keys its caches by the schemas of Parrot's operators as they are now (beside any
    tag already set), to enter around calls that may compile graphs calling them. One object, entered each time:
    each patch() is a new context variable, and its set() stays in the calling thread's context for good."""
    return torch.compiler.config.patch(cache_key_tag=torch.compiler.config.cache_key_tag + operators_cache_tag())


_torch_ops_lock = threading.Lock()


def torch_ops() -> bool:
    """Whether the torch operators with C++ bodies (native/torch_ops.cpp) are loaded here: see _load_torch_ops.
    The lock keeps two engines built at once from loading them (and registering their fakes) twice."""
    with _torch_ops_lock:
        return _load_torch_ops()


@functools.cache
def _load_torch_ops() -> bool:
    """Whether the torch operators with C++ bodies (native/torch_ops.cpp: parrot_native::linear, ::gated_linear,
    ::linear_q4, ::linear_q8 and a compiled forward's ::attention) are loaded here, built on first use against
    this torch's headers (slow, once: cached as library() is). False where that fails (one warning says why) or
    the native kernels are switched off: the Python-bodied ops of kernels/native_linear.py and
    engines/builtin/compiled_model.py serve then."""
    if library() is None:
        return False
    from torch.utils import cpp_extension

    flags = ("-std=c++20", "-w", f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}",
             *(f"-I{path}" for path in cpp_extension.include_paths()),
             *(f"-L{path}" for path in cpp_extension.library_paths()), "-lc10", "-ltorch_cpu")
    try:
        built = _built(_compiler(), TORCH_OPS_SOURCES, "parrot_torch_ops", flags, keyed_by=(torch.__version__,))
        torch.ops.load_library(str(built))
    except (OSError, RuntimeError, subprocess.CalledProcessError) as exc:
        log.warning("building the native torch operators failed, their Python-bodied ops serve: %s", exc)
        return False
    # What compiled graphs trace them by: their outputs' shapes.
    torch.library.register_fake("parrot_native::linear")(
        lambda x, packed, bias: x.new_empty(x.shape[0], linear_shape(packed)[0]))
    torch.library.register_fake("parrot_native::gated_linear")(
        lambda x, packed: x.new_empty(x.shape[0], linear_shape(packed)[0] // 2))
    for format in GROUPED_BLOCK_BYTES_PER_INPUT:
        torch.library.register_fake(f"parrot_native::linear_{format}")(
            lambda x, packed, bias: x.new_empty(x.shape[0], packed.shape[0] * LINEAR_BLOCK))
    torch.library.register_fake("parrot_native::attention")(lambda q, k, v, forward, layer: torch.empty_like(q))
    return True


def compile_sources(compiler: str, sources, target: Path, flags: tuple[str, ...] = ()) -> None:
    """The library built from ``sources`` with this module's flags and ``flags`` (also benchmarks.kernel_revisions'
    other build)."""
    command = [compiler, *FLAGS, "-o", str(target), *map(str, sources), *flags]  # libraries after the objects
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise subprocess.CalledProcessError(result.returncode, result.args, stderr=result.stderr[-2000:])
