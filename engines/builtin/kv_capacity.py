"""The KV cache's size, planned by bytes: a memory budget (EngineConfig's kv_cache_memory, or a fraction of the
memory available at start) divided by what a block of every layer's keys and values takes in the model's
dtype; and from it, the longest a sequence can ever be, which a request is held to (a 400 beyond it)."""

from __future__ import annotations

import psutil
import torch

from engines.builtin.config import EngineConfig
from engines.builtin.model import head_dim_of


def kv_block_bytes(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block of KV: keys and values of ``block_size`` tokens in every layer."""
    per_token = 2 * hf_config.num_hidden_layers * hf_config.num_key_value_heads * head_dim_of(hf_config)
    return per_token * block_size * torch.finfo(dtype).bits // 8


def kv_budget_bytes(config: EngineConfig) -> int:
    """The cache's memory: kv_cache_memory_fraction of what the host has available now (the weights loaded), else
    kv_cache_memory."""
    if config.kv_cache_memory_fraction is not None:
        return int(psutil.virtual_memory().available * config.kv_cache_memory_fraction)
    return config.kv_cache_memory


def planned_blocks(config: EngineConfig, hf_config, dtype: torch.dtype) -> int:
    """num_blocks where set, else as many blocks as the budget holds; ValueError where that is none."""
    if config.num_blocks:
        return config.num_blocks
    block_bytes = kv_block_bytes(hf_config, config.block_size, dtype)
    blocks = kv_budget_bytes(config) // block_bytes
    if blocks < 1:
        raise ValueError(f"the KV cache's budget of {kv_budget_bytes(config)} bytes holds no block of {block_bytes} "
                         f"bytes ({config.block_size} tokens of {hf_config.num_hidden_layers} layers)")
    return blocks


def longest_sequence(config: EngineConfig, hf_config, num_blocks: int, freeing_window: int | None) -> int:
    """The most tokens a sequence may ever hold: the model's context (or max_model_len), at most what the cache
    holds of one sequence on its own (or preemption could not help it), unless every layer has a sliding window
    whose blocks are freed behind it (block_manager.py): a sequence then holds at most its window and a step's
    chunk at once, and the cache bounds nothing else."""
    model_len = config.max_model_len or hf_config.max_position_embeddings
    size = config.block_size
    if freeing_window is not None and num_blocks * size >= freeing_window + config.max_num_batched_tokens + 2 * size:
        return model_len
    return min(model_len, num_blocks * size)
