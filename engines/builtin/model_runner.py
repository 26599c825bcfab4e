"""Runs one scheduled step: builds the batch tensors (the one place they are built), runs the
model over the paged KV cache and samples the sequences that are due a token."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace

import torch

from engines.builtin.attention import AttentionMetadata, DecodeMetadata, PrefillMetadata, SharedPrefixMetadata
from engines.builtin.model import CausalLM, head_dim_of
from engines.builtin.greedy_head import GreedyHead
from engines.builtin.sampler import SampleResult, Sampler, score_tokens
from engines.builtin.context import Context
from engines.builtin.types import TokenScore
from kernels import native as native_module
from kernels import cpu_attention, dispatch
from kernels.native import PreparedDecode

log = logging.getLogger(__name__)

# The Triton and C++ shared-prefix kernels always beat paged decode; the torch CPU path only once the prefix it
# spares re-reading is long: ahead at 400 shared tokens, behind at 200 (python -m benchmarks.engine_decode --forks;
# the figures: docs/engine.md, "Measurements behind design choices").
CPU_MIN_SHARED_TOKENS = 320


@dataclass
class PrefixGroup:
    """Decodes whose block tables start with the same ``num_blocks`` (full, shared) blocks."""

    num_blocks: int
    members: list[int]  # indices into the batch's decode entries


@dataclass
class ScheduledBatch:
    # (sequence, tokens to compute this step); single-token entries (decodes) first.
    entries: list[tuple[Context, int]]
    prefix_groups: list[PrefixGroup] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def sampled(self) -> list[Context]:
        """Sequences that reach the end of their tokens this step and want a next token."""
        return [ctx for ctx, n in self.entries if not ctx.is_fill and ctx.num_computed_tokens + n == len(ctx)]


@dataclass
class StepResult:
    samples: SampleResult | None  # the next token of each of the batch's ``sampled()`` sequences
    # Scoring fills: (sequence, position of its first scored token, scores of this step's positions).
    scores: list[tuple[Context, int, list[TokenScore]]] = field(default_factory=list)


# Score rows go through log-softmax this many at a time: a 1024-token chunk's logits are 200 MB
# for a 49k vocabulary, and each pass copies them.
SCORE_ROWS_PER_PASS = 256


class ModelRunner:
    def __init__(self, model: CausalLM, num_blocks: int, block_size: int, seed: int, device: str = "cpu",
                 *, compile: bool = False):
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.block_size = block_size
        self.num_blocks = num_blocks
        config = model.config
        dtype = model.model.embed_tokens.weight.dtype  # linears may be quantized
        shape = (num_blocks, block_size, config.num_key_value_heads, head_dim_of(config))
        for layer in model.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=dtype, device=self.device)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=dtype, device=self.device)
        self.query_group = config.num_attention_heads // config.num_key_value_heads
        native_library = native_module.library()
        self.sampler = Sampler(seed, native_library.argmax_rows if native_library is not None else None)
        triton = dispatch.uses_triton(self.device)
        query = torch.empty(1, config.num_attention_heads, shape[-1], dtype=dtype, device=self.device)
        # The C++ kernels where they take this model's attention; they also take a step's KV writes and
        # decodes with arguments prepared once for all layers.
        self.native_kernels = None if triton else dispatch.native_decode(query, model.model.layers[0].self_attn.k_cache)
        native = self.native_kernels is not None
        # What a step calls: the model's last_hidden, or its compiled forward (same arguments, same hidden states).
        self.last_hidden = self.model.last_hidden
        # An all-greedy step's few tokens from the head's int8 screen (the same tokens as its logits' argmax).
        self.greedy_head = GreedyHead.of(self.model) if self.device.type == "cpu" else None
        if compile and (model.architecture.needs_general_attention(model.model.rotary.max_len) or model.architecture.experts):
            log.warning("--compile: %s's soft-capped or windowed attention or routed experts are not in the compiled "
                        "graph yet; running eagerly", model.architecture.model_type)
            compile = False
        self.compiled = compile
        if compile:
            # Imported only here: importing torch._inductor breaks Triton kernels run later through the
            # interpreter in the same process (tests on CPU), and an eager engine never needs it.
            from engines.builtin.compile_cache import use_compile_cache

            use_compile_cache()  # before inductor is imported (compile_cache.py says why)
            from engines.builtin.compiled_model import CompiledForward

            self.last_hidden = CompiledForward(self.model, native_attention=native and native_module.torch_ops())
        self.native_dtype = dtype if native else None  # prefill chunks laid out in its tiles (plan_prefill)
        # Mean shared-prefix tokens per decode from which prefix groups go to the shared-prefix kernel.
        self.min_shared_tokens = 0 if triton or native else CPU_MIN_SHARED_TOKENS
        # Whether decodes run the torch CPU paths, whose reads are planned once per step (prefills always do on
        # CPU: their chunks laid out in tiles for the native kernel where it runs).
        self.plans_torch_decode = not triton and not native
        # The layers' sliding windows, each read through metadata of its own in a step with a longer sequence
        # (attention.py); none where every layer's scores are soft-capped (windowed_attention takes them all).
        arch = model.architecture
        self.windows = () if arch.attention_softcap else tuple(sorted({w for w in arch.layer_windows if w}))

    def copy_rows(self, src_block: int, dst_block: int, num_rows: int) -> None:
        for layer in self.model.model.layers:
            attn = layer.self_attn
            attn.k_cache[dst_block, :num_rows] = attn.k_cache[src_block, :num_rows]
            attn.v_cache[dst_block, :num_rows] = attn.v_cache[src_block, :num_rows]

    @torch.inference_mode()  # the step's metadata too: a compiled graph's guards tell inference tensors apart
    def run(self, batch: ScheduledBatch) -> StepResult:
        input_ids, positions, meta, logit_rows, sampled, scored = self.prepare(batch)
        hidden = self.last_hidden(input_ids, positions, meta, logit_rows)
        # Sampled rows come first, then the scored ones.
        if sampled and not scored and self.greedy_head is not None:
            tokens = self.greedy_head(hidden, sampled)
            if tokens is not None:
                return StepResult(SampleResult(tokens), [])
        logits = None if hidden is None else self.model.logits(hidden)
        # The sampler works on the host.
        samples = self.sampler(logits[: len(sampled)].cpu(), sampled) if sampled else None
        return StepResult(samples, self._scores(logits[len(sampled):], scored) if scored else [])

    @staticmethod
    def _scores(logits: torch.Tensor, scored: list[tuple[Context, int, int]]) -> list[tuple[Context, int, list[TokenScore]]]:
        """Scores of each (sequence, first position, end position): row p predicts prompt token p + 1."""
        targets = [t for ctx, first, end in scored for t in ctx.token_ids[first + 1 : end + 1]]
        top_k = [ctx.score_top_k for ctx, first, end in scored for _ in range(first, end)]
        flat: list[TokenScore] = []
        for at in range(0, len(targets), SCORE_ROWS_PER_PASS):
            part = slice(at, at + SCORE_ROWS_PER_PASS)
            flat += score_tokens(logits[part].cpu(), targets[part], top_k[part])
        out, at = [], 0
        for ctx, first, end in scored:
            out.append((ctx, first + 1, flat[at : at + end - first]))
            at += end - first
        return out

    def prepare(self, batch: ScheduledBatch):
        size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Context] = []
        score_rows: list[int] = []
        scored: list[tuple[Context, int, int]] = []  # (sequence, first row position, end position)
        decodes: list[Context] = []
        prefills: list[tuple[Context, int]] = []
        for ctx, n in batch.entries:
            start = ctx.num_computed_tokens
            row = len(token_ids)
            token_ids += ctx.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [ctx.block_table[p // size] * size + p % size for p in range(start, start + n)]
            if n == 1:  # a one-token chunk attends like a decode
                decodes.append(ctx)
            else:
                prefills.append((ctx, n))
            if not ctx.is_fill and start + n == len(ctx):
                logit_rows.append(row + n - 1)
                sampled.append(ctx)
            end = min(start + n, len(ctx) - 1)  # rows before the last one predict a prompt token
            if ctx.score_top_k is not None and end > start:
                score_rows += range(row, row + end - start)
                scored.append((ctx, start, end))
        meta = AttentionMetadata(slot_mapping=self._tensor(slots, torch.long), num_decodes=len(decodes),
                                 longest_context=max(ctx.num_computed_tokens + n for ctx, n in batch.entries))
        if self.native_kernels:
            meta.kv_write = self.native_kernels.prepare_kv_write(meta.slot_mapping)
        if decodes and self._worth_sharing(batch.prefix_groups, len(decodes)):
            meta.shared_prefix = self._shared_prefix(decodes, batch.prefix_groups)
        elif decodes:
            meta.decode = self._decode(decodes)
        if prefills:
            meta.prefill = self._prefill(prefills)
        if self.native_kernels:
            meta.native = self._native(meta)
        for window in self.windows:
            if meta.longest_context > window:
                meta.windows[window] = self._windowed(meta, decodes, window)
        logit_rows += score_rows
        rows = self._tensor(logit_rows, torch.long) if logit_rows else None
        return self._tensor(token_ids, torch.long), self._tensor(positions, torch.long), meta, rows, sampled, scored

    @property
    def plans_cpu_attention(self) -> bool:
        """Whether this step's attention runs the torch CPU paths, whose reads are planned once per step."""
        return not dispatch.uses_triton(self.device)

    def _worth_sharing(self, groups: list[PrefixGroup], num_decodes: int) -> bool:
        shared_tokens = sum(g.num_blocks * self.block_size * len(g.members) for g in groups)
        return bool(groups) and shared_tokens >= self.min_shared_tokens * num_decodes

    def _tensor(self, values: list, dtype: torch.dtype = torch.int32) -> torch.Tensor:
        return torch.tensor(values, dtype=dtype).to(self.device, non_blocking=True)

    def _tables(self, tables: list[list[int]]) -> torch.Tensor:
        """Block tables padded with block 0 (never read past a row's length) -> [rows, max_blocks]."""
        width = max(1, max(map(len, tables)))
        return self._tensor([table + [0] * (width - len(table)) for table in tables])

    def _blocks(self, length: int) -> int:
        return -(-length // self.block_size)

    def _decode(self, seqs: list[Context], window: int | None = None) -> DecodeMetadata:
        lens = [ctx.num_computed_tokens + 1 for ctx in seqs]
        tables = [ctx.block_table[: self._blocks(n)] for ctx, n in zip(seqs, lens)]
        meta = DecodeMetadata(self._tables(tables), self._tensor(lens))
        if self.plans_torch_decode:
            meta.plan = cpu_attention.plan_decode(meta.block_tables, meta.context_lens, self.block_size, window)
        return meta

    def _windowed(self, meta: AttentionMetadata, decodes: list[Context], window: int) -> AttentionMetadata:
        """The step's metadata for layers with a sliding ``window``: the same rows, each decode on its own, the
        reads planned (and on the C++ kernel laid out) from each row's window's first key."""
        windowed = AttentionMetadata(slot_mapping=meta.slot_mapping, num_decodes=meta.num_decodes,
                                     longest_context=meta.longest_context, window=window)
        if decodes:
            windowed.decode = self._decode(decodes, window)
        if meta.prefill is not None:
            prefill = meta.prefill
            windowed.prefill = replace(prefill, plan=None if not self.plans_cpu_attention else cpu_attention.plan_prefill(
                prefill.block_tables, prefill.cu_seqlens_q, prefill.context_lens, self.block_size,
                native_dtype=self.native_dtype, window=window))
        if self.native_kernels:
            windowed.native = self._native(windowed)
        return windowed

    def _shared_prefix(self, seqs: list[Context], groups: list[PrefixGroup]) -> SharedPrefixMetadata:
        prefix_ids = [-1] * len(seqs)
        shared_blocks = [0] * len(seqs)
        for group_id, group in enumerate(groups):
            for i in group.members:
                prefix_ids[i], shared_blocks[i] = group_id, group.num_blocks
        lens = [ctx.num_computed_tokens + 1 - shared * self.block_size for ctx, shared in zip(seqs, shared_blocks)]
        suffix_tables = [
            ctx.block_table[shared : shared + self._blocks(n)] for ctx, shared, n in zip(seqs, shared_blocks, lens)
        ]
        prefix_tables = [seqs[g.members[0]].block_table[: g.num_blocks] for g in groups]
        meta = SharedPrefixMetadata(
            prefix_ids=self._tensor(prefix_ids),
            prefix_block_tables=self._tables(prefix_tables),
            prefix_lens=self._tensor([g.num_blocks * self.block_size for g in groups]),
            suffix_block_tables=self._tables(suffix_tables),
            suffix_lens=self._tensor(lens),
        )
        if self.plans_torch_decode:
            meta.plan = cpu_attention.plan_shared_prefix(
                meta.prefix_ids, meta.prefix_block_tables, meta.prefix_lens, meta.suffix_block_tables,
                meta.suffix_lens, self.block_size, query_group=self.query_group)
        return meta

    def _prefill(self, chunks: list[tuple[Context, int]]) -> PrefillMetadata:
        lens = [ctx.num_computed_tokens + n for ctx, n in chunks]
        cu_seqlens = [0]
        for _, n in chunks:
            cu_seqlens.append(cu_seqlens[-1] + n)
        tables = [ctx.block_table[: self._blocks(length)] for (ctx, _), length in zip(chunks, lens)]
        meta = PrefillMetadata(
            self._tables(tables), self._tensor(cu_seqlens), self._tensor(lens), max(n for _, n in chunks)
        )
        if self.plans_cpu_attention:
            meta.plan = cpu_attention.plan_prefill(meta.block_tables, meta.cu_seqlens_q, meta.context_lens,
                                                   self.block_size, native_dtype=self.native_dtype)
        return meta

    def _native(self, meta: AttentionMetadata) -> PreparedDecode:
        """The step's decodes and prefill chunks as one call of the C++ kernel (cpu_attention.join_rows)."""
        parts = []
        if meta.shared_prefix is not None:
            shared = meta.shared_prefix
            parts.append(cpu_attention.decode_rows(shared.suffix_block_tables, shared.suffix_lens,
                                                   (shared.prefix_ids, shared.prefix_block_tables, shared.prefix_lens)))
        elif meta.decode is not None and meta.window is not None:
            parts.append(cpu_attention.windowed_decode_rows(meta.decode.block_tables, meta.decode.context_lens,
                                                            meta.window, self.block_size))
        elif meta.decode is not None:
            parts.append(cpu_attention.decode_rows(meta.decode.block_tables, meta.decode.context_lens))
        if meta.prefill is not None:
            parts += [chunk.cached_rows for chunk in meta.prefill.plan]
        rows = cpu_attention.join_rows(parts, self.block_size)
        return self.native_kernels.prepare_decode(rows.own_tables, rows.own_lens,
                                                  (rows.prefix_ids, rows.prefix_table, rows.prefix_len), rows.firsts)
