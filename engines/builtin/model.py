"""Llama-family decoder (SmolLM2, Llama 2/3, Qwen2-style qkv bias) over a paged KV cache.

Inputs are one flat batch of tokens from many sequences (no padding); cache slots, block tables
and context lengths come from the step's ``AttentionMetadata``. q/k/v and gate/up projections
are fused into one matmul each: at 135M parameters the per-op Python overhead of 30 layers
is a large part of a decode step.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin.attention import AttentionMetadata, paged_attention

# (q, k, v, layer index) -> the layer's attention output: how a layer reaches its paged KV cache.
# Eager forwards close over the step's metadata; the compiled one calls a custom op (compiled_model.py).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32:
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        # As HF rounds it in 16 bits: normalised in fp32, rounded, then scaled in the model's dtype.
        return self.weight * F.rms_norm(x.float(), self.weight.shape, None, self.eps).to(x.dtype)


class RotaryEmbedding(nn.Module):
    def __init__(self, config, max_len: int):
        super().__init__()
        inv_freq, scaling = rope_inverse_frequencies(config)
        freqs = torch.outer(torch.arange(max_len, dtype=torch.float32), inv_freq)  # [max_len, d/2]
        self.register_buffer("cos", freqs.cos() * scaling, persistent=False)
        self.register_buffer("sin", freqs.sin() * scaling, persistent=False)

    def forward(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        # [num_tokens, 1, d/2] each, broadcast over heads; gathered once per step for all layers.
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def rope_inverse_frequencies(config) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and scale via transformers' own rope table (llama3, yarn, linear...)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type != "default":
        return ROPE_INIT_FUNCTIONS[rope_type](config)
    theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
    dim = head_dim_of(config)
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)), 1.0


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, d]; HF's rotate-half convention.
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = self.head_dim**-0.5
        qkv_bias = getattr(config, "attention_bias", False) or config.model_type == "qwen2"
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim, bias=qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=getattr(config, "attention_bias", False))
        # Set by the runner once the cache is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x, cos, sin, attend: Attend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The attention's output for every token, or only for `rows` (the cache is written for all)."""
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1)
        # Rotate q and k in one go: they are adjacent heads of the same fused projection.
        qk = apply_rope(qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim), cos, sin)
        q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v, self.layer_index).reshape(num_tokens, -1)
        return self.o_proj(out if rows is None else out[rows])


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class DecoderLayer(nn.Module):
    def __init__(self, config, layer_index: int):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config)

    def forward(self, x, cos, sin, attend: Attend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's output, or only `rows`' (the last layer's, where only some tokens' logits are wanted)."""
        attended = self.self_attn(self.input_layernorm(x), cos, sin, attend, rows)
        x = (x if rows is None else x[rows]) + attended
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    def __init__(self, config, max_len: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_len)


def rows_to_finish(input_ids: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor:
    """The rows the last layer finishes: those whose logits are wanted, or (none wanted: a prompt's chunk)
    the last token's alone, so that a compiled graph never sees an empty dimension."""
    if logit_rows is not None:
        return logit_rows
    return torch.full((1,), input_ids.shape[0] - 1, dtype=torch.long, device=input_ids.device)


class LlamaForCausalLM(nn.Module):
    # HF parameter names that we store fused: ours -> its parts, in concatenation order.
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config, max_len: int):
        super().__init__()
        self.config = config
        self.model = LlamaModel(config, max_len)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight

    @torch.inference_mode()
    def last_hidden(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata,
                    logit_rows: torch.Tensor | None) -> torch.Tensor | None:
        """The last layer's hidden states of the rows at logit_rows, [num_samples, hidden], before the final norm
        (logits() takes the head of them); None without logit_rows."""
        hidden = self.decoder(input_ids, positions, self.paged_attention(meta), rows_to_finish(input_ids, logit_rows))
        return None if logit_rows is None else hidden

    def decoder(self, input_ids: torch.Tensor, positions: torch.Tensor, attend: Attend, rows: torch.Tensor) -> torch.Tensor:
        """Hidden states after the last layer of the tokens at `rows`, [len(rows), hidden].

        Only those go through the last layer's o_proj and MLP: every token's keys and values are cached by
        then, and a prefill wants one token's logits (1/30 of a 1,000-token prefill's linears, SmolLM2)."""
        cos, sin = self.model.rotary(positions)
        x = self.model.embed_tokens(input_ids)
        *layers, last = self.model.layers
        for layer in layers:
            x = layer(x, cos, sin, attend)
        return last(x, cos, sin, attend, rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary-wide head over the decoder's rows (the tokens whose next-token logits are wanted)."""
        return self.lm_head(self.head_input(hidden)).float()

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head multiplies: the decoder's rows after the final norm (also the greedy head's input)."""
        return self.model.norm(hidden)

    def paged_attention(self, meta: AttentionMetadata) -> Attend:
        """Each layer's attention over its own cache, for one step's metadata."""
        attentions = [layer.self_attn for layer in self.model.layers]  # a ModuleList's indexing costs microseconds

        def attend(q, k, v, layer_index: int) -> torch.Tensor:
            attn = attentions[layer_index]
            return paged_attention(q, k, v, attn.k_cache, attn.v_cache, meta, attn.scale)

        return attend
