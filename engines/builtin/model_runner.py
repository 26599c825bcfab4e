"""Runs one scheduled step: builds the batch tensors (the one place they are built), runs the
model over the paged KV cache and samples the sequences that are due a token."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engines.builtin.attention import AttentionMetadata, PrefillSpan
from engines.builtin.model import LlamaForCausalLM, head_dim_of
from engines.builtin.sampler import SampleResult, Sampler
from engines.builtin.sequence import Sequence


@dataclass
class ScheduledBatch:
    # (sequence, tokens to compute this step); single-token entries (decodes) first.
    entries: list[tuple[Sequence, int]]

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.entries)

    def sampled(self) -> list[Sequence]:
        """Sequences that reach the end of their tokens this step and want a next token."""
        return [seq for seq, n in self.entries if not seq.is_fill and seq.num_computed_tokens + n == len(seq)]


def kv_block_bytes(hf_config, block_size: int, dtype: torch.dtype) -> int:
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim_of(hf_config)
    return per_token * block_size * torch.finfo(dtype).bits // 8


class ModelRunner:
    def __init__(self, model: LlamaForCausalLM, num_blocks: int, block_size: int, seed: int):
        self.model = model
        self.block_size = block_size
        config = model.config
        dtype = model.lm_head.weight.dtype
        shape = (num_blocks, block_size, config.num_key_value_heads, head_dim_of(config))
        for layer in model.model.layers:
            layer.self_attn.k_cache = torch.zeros(shape, dtype=dtype)
            layer.self_attn.v_cache = torch.zeros(shape, dtype=dtype)
        self.sampler = Sampler(seed)

    def copy_rows(self, src_block: int, dst_block: int, num_rows: int) -> None:
        for layer in self.model.model.layers:
            attn = layer.self_attn
            attn.k_cache[dst_block, :num_rows] = attn.k_cache[src_block, :num_rows]
            attn.v_cache[dst_block, :num_rows] = attn.v_cache[src_block, :num_rows]

    def run(self, batch: ScheduledBatch) -> SampleResult | None:
        input_ids, positions, meta, logit_rows, sampled = self.prepare(batch)
        logits = self.model(input_ids, positions, meta, logit_rows)
        return self.sampler(logits, sampled) if sampled else None

    def prepare(self, batch: ScheduledBatch):
        size = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        logit_rows: list[int] = []
        sampled: list[Sequence] = []
        decodes: list[Sequence] = []
        meta = AttentionMetadata(slot_mapping=torch.empty(0))
        for seq, n in batch.entries:
            start = seq.num_computed_tokens
            row = len(token_ids)
            token_ids += seq.token_ids[start : start + n]
            positions += range(start, start + n)
            slots += [seq.block_table[p // size] * size + p % size for p in range(start, start + n)]
            if n == 1:
                decodes.append(seq)
            else:
                meta.prefills.append(self._prefill_span(seq, row, n))
            if not seq.is_fill and start + n == len(seq):
                logit_rows.append(row + n - 1)
                sampled.append(seq)
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long)
        if decodes:
            meta.num_decodes = len(decodes)
            meta.decode_slots, meta.decode_mask = self._decode_context(decodes)
        rows = torch.tensor(logit_rows, dtype=torch.long) if logit_rows else None
        return torch.tensor(token_ids, dtype=torch.long), torch.tensor(positions, dtype=torch.long), meta, rows, sampled

    def _context_slots(self, block_tables: torch.Tensor, length: int) -> torch.Tensor:
        # block_tables: [batch, max_blocks] -> [batch, length] cache slot of each position
        position = torch.arange(length)
        return block_tables[:, position // self.block_size] * self.block_size + position % self.block_size

    def _decode_context(self, seqs: list[Sequence]) -> tuple[torch.Tensor, torch.Tensor | None]:
        context_lens = torch.tensor([seq.num_computed_tokens + 1 for seq in seqs])
        max_len = int(context_lens.max())
        max_blocks = -(-max_len // self.block_size)
        tables = torch.tensor([seq.block_table[:max_blocks] + [0] * (max_blocks - len(seq.block_table[:max_blocks])) for seq in seqs])
        slots = self._context_slots(tables, max_len)
        if bool((context_lens == max_len).all()):
            return slots, None
        mask = torch.arange(max_len).unsqueeze(0) < context_lens.unsqueeze(1)  # [batch, max_len]
        return slots, mask[:, None, None, :]

    def _prefill_span(self, seq: Sequence, row: int, n: int) -> PrefillSpan:
        start = seq.num_computed_tokens
        if start == 0:
            return PrefillSpan(row, row + n)
        length = start + n
        tables = torch.tensor([seq.block_table[: -(-length // self.block_size)]])
        context_slots = self._context_slots(tables, length)[0]
        # Query i (absolute position start + i) sees keys 0 .. start + i.
        mask = torch.arange(length).unsqueeze(0) <= (start + torch.arange(n)).unsqueeze(1)
        return PrefillSpan(row, row + n, context_slots, mask)
