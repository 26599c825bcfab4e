"""One decoder module tree for every family the engine runs (Llama, Mistral, Qwen2/3, Qwen2/3-MoE, Gemma 2/3,
Phi-3), over a paged KV cache.

Families differ in a few pieces, and ``Architecture`` (read from the checkpoint's config, nowhere else) says
which: Gemma's norms scale by (1 + w) and sandwich each block, its embeddings are scaled by sqrt(hidden), its
MLP is GELU-tanh, its attention may be soft-capped and alternate sliding-window and global layers; Qwen3 and
Gemma 3 normalise each head's q and k; Phi-3 rotates part of each head with its own rope scaling; the MoE
families route each token to a few experts. Everything else is shared. A family's checkpoint that the engine
cannot run is refused by ``architecture_of`` with its name, before any weight is read.

Inputs are one flat batch of tokens from many sequences (no padding); cache slots, block tables
and context lengths come from the step's ``AttentionMetadata``. q/k/v and gate/up projections
are fused into one matmul each: at 135M parameters the per-op Python overhead of 30 layers
is a large part of a decode step.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from engines.builtin.attention import AttentionMetadata, paged_attention
from engines.builtin.errors import UnsupportedArchitecture
from engines.builtin.families import unsupported_reason

# (q, k, v, layer index) -> the layer's attention output: how a layer reaches its paged KV cache.
# Eager forwards close over the step's metadata; the compiled one calls a custom op (compiled_model.py).
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]

GEMMA = ("gemma2", "gemma3_text")


@dataclass(frozen=True)
class Experts:
    """A mixture-of-experts MLP's shape: routed experts, how many a token takes, and the optional shared one."""

    num_experts: int
    top_k: int
    intermediate_size: int
    normalize_top_k: bool
    shared_intermediate_size: int  # 0: no shared expert
    sparse_layers: frozenset[int]


@dataclass(frozen=True)
class Architecture:
    """What the checkpoint's config says about the decoder, for the pieces in which families differ."""

    model_type: str
    norm_offset: float  # Gemma's RMSNorm scales by (1 + w): folded into the weight at load
    sandwich_norms: bool  # Gemma 2/3: a norm after attention and around the MLP too
    head_norms: bool  # Qwen3, Gemma 3: RMSNorm over each head's q and k before rope
    embedding_scale: float | None
    activation: str  # transformers' ACT2FN name
    attention_scale: float
    attention_softcap: float | None  # Gemma 2: cap * tanh(score / cap) before the softmax
    final_softcap: float | None
    layer_windows: tuple[int | None, ...]  # each layer's sliding window (keys within it of the query), None: global
    layer_rope: tuple[str, ...]  # each layer's rope table (Gemma 3: local and global tables differ)
    rotary_dim: int
    qkv_bias: bool
    o_bias: bool
    experts: Experts | None

    @property
    def freeing_window(self) -> int | None:
        """The widest sliding window where every layer has one: keys further back than it from a sequence's next
        token are seen by no layer, so their KV blocks may be freed (block_manager.py); None where some layer
        attends to the whole context (Gemma's global layers: one block table serves every layer)."""
        windows = self.layer_windows
        return max(windows) if windows and all(windows) else None

    def needs_general_attention(self, max_len: int) -> bool:
        """Whether some layer's attention is soft-capped, or windowed more narrowly than ``max_len`` tokens (a
        window as long as the context is none): the torch path that takes both."""
        return self.attention_softcap is not None or any(w is not None and w < max_len for w in self.layer_windows)


def architecture_of(config) -> Architecture:
    """The decoder's pieces for this config; UnsupportedArchitecture names what the engine cannot run."""
    model_type = getattr(config, "model_type", None)
    reason = unsupported_reason(model_type, getattr(config, "architectures", None))
    if reason:
        raise UnsupportedArchitecture(reason)
    gemma = model_type in GEMMA
    head_dim = head_dim_of(config)
    layers = config.num_hidden_layers
    layer_types = list(getattr(config, "layer_types", None) or ["full_attention"] * layers)
    window = getattr(config, "sliding_window", None)
    if model_type in ("mistral", "phi3"):  # every layer windowed when the config has one (transformers does so)
        windows = tuple(window for _ in range(layers))
    else:
        windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
    params = getattr(config, "rope_parameters", None) or {}
    nested = all(kind in params for kind in set(layer_types))  # Gemma 3: a rope per layer type
    rotary = int(head_dim * (params.get("partial_rotary_factor") or getattr(config, "partial_rotary_factor", 1.0) or 1.0))
    return Architecture(
        model_type=model_type,
        norm_offset=1.0 if gemma else 0.0,
        sandwich_norms=gemma,
        head_norms=model_type in ("qwen3", "qwen3_moe", "gemma3_text"),
        embedding_scale=config.hidden_size**0.5 if gemma else None,
        activation=getattr(config, "hidden_activation", None) or config.hidden_act,
        attention_scale=(config.query_pre_attn_scalar if gemma else head_dim) ** -0.5,
        # Gemma 3's config carries the field too, but transformers' Gemma 3 attention never applies it.
        attention_softcap=getattr(config, "attn_logit_softcapping", None) if model_type == "gemma2" else None,
        final_softcap=getattr(config, "final_logit_softcapping", None),
        layer_windows=windows,
        layer_rope=tuple(layer_types) if nested else ("default",) * layers,
        rotary_dim=rotary,
        qkv_bias=bool(getattr(config, "attention_bias", False) or getattr(config, "qkv_bias", False)
                      or model_type == "qwen2"),
        o_bias=bool(getattr(config, "attention_bias", False)),
        experts=experts_of(config),
    )


def experts_of(config) -> Experts | None:
    if config.model_type not in ("qwen2_moe", "qwen3_moe") or not config.num_experts:
        return None
    step = getattr(config, "decoder_sparse_step", 1) or 1
    dense = set(getattr(config, "mlp_only_layers", None) or [])
    return Experts(
        num_experts=config.num_experts,
        top_k=config.num_experts_per_tok,
        intermediate_size=config.moe_intermediate_size,
        normalize_top_k=bool(config.norm_topk_prob),
        shared_intermediate_size=getattr(config, "shared_expert_intermediate_size", 0) or 0,
        sparse_layers=frozenset(i for i in range(config.num_hidden_layers) if i not in dense and (i + 1) % step == 0),
    )


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
    """The cos and sin tables of every rope the layers use (one, or Gemma 3's local and global), by position."""

    def __init__(self, config, max_len: int):
        super().__init__()
        self.max_len = max_len
        self.kinds = sorted(set(architecture_of(config).layer_rope))
        for kind in self.kinds:
            cos, sin = rope_table(config, kind, max_len)
            self.register_buffer(f"{kind}_cos", cos, persistent=False)
            self.register_buffer(f"{kind}_sin", sin, persistent=False)

    def forward(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        # [num_tokens, 1, d/2] each, broadcast over heads; gathered once per step for all layers.
        return {kind: (getattr(self, f"{kind}_cos")[positions].unsqueeze(1),
                       getattr(self, f"{kind}_sin")[positions].unsqueeze(1)) for kind in self.kinds}


def rope_table(config, kind: str, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_len, rotary_dim/2], of the rope named ``kind`` ("default" or a layer type)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    params = getattr(config, "rope_parameters", None) or {}
    layer_type = None if kind == "default" else kind
    if layer_type:
        params = params[layer_type]
    rope_type = params.get("rope_type", "default")
    positions = torch.arange(max_len, dtype=torch.float32)
    if rope_type == "default":
        theta = params.get("rope_theta", getattr(config, "rope_theta", 10000.0))
        dim = architecture_of(config).rotary_dim
        inv_freq, scaling = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)), 1.0
        freqs = torch.outer(positions, inv_freq)
    elif rope_type == "longrope":
        # Phi-3: the short factors up to the pretraining length, the long ones past it (as vLLM: a position's
        # rotation does not change as its sequence grows; transformers switches every position at once).
        original = params["original_max_position_embeddings"]
        short, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, layer_type=layer_type)
        long, _ = ROPE_INIT_FUNCTIONS[rope_type](config, None, seq_len=original + 1, layer_type=layer_type)
        freqs = torch.where(positions[:, None] < original, torch.outer(positions, short), torch.outer(positions, long))
    else:  # llama3, yarn, linear, ...: transformers' own table
        kwargs = {"layer_type": layer_type} if layer_type else {}
        inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
        freqs = torch.outer(positions, inv_freq)
    return freqs.cos() * scaling, freqs.sin() * scaling


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [num_tokens, heads, d]; HF's rotate-half convention, over the first 2 * cos.shape[-1] dims of each head.
    rotary = 2 * cos.shape[-1]
    if rotary < x.shape[-1]:
        return torch.cat((apply_rope(x[..., :rotary], cos, sin), x[..., rotary:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


def head_dim_of(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class Attention(nn.Module):
    def __init__(self, config, arch: Architecture, layer_index: int):
        super().__init__()
        self.layer_index = layer_index
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = head_dim_of(config)
        self.scale = arch.attention_scale
        self.window = arch.layer_windows[layer_index]
        self.softcap = arch.attention_softcap
        self.rope = arch.layer_rope[layer_index]
        self.qkv_proj = nn.Linear(config.hidden_size, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim,
                                  bias=arch.qkv_bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=arch.o_bias)
        if arch.head_norms:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Set by the runner once the cache is allocated: [num_blocks, block_size, kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)

    def forward(self, x, rope, attend: Attend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """The attention's output for every token, or only for `rows` (the cache is written for all)."""
        num_tokens = x.shape[0]
        cos, sin = rope[self.rope]
        qkv = self.qkv_proj(x)
        qk, v = qkv.split([(self.num_heads + self.num_kv_heads) * self.head_dim, self.num_kv_heads * self.head_dim], dim=-1)
        qk = qk.view(num_tokens, self.num_heads + self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = qk.split([self.num_heads, self.num_kv_heads], dim=1)
            qk = torch.cat([self.q_norm(q), self.k_norm(k)], dim=1)
        # Rotate q and k in one go: they are adjacent heads of the same fused projection.
        q, k = apply_rope(qk, cos, sin).split([self.num_heads, self.num_kv_heads], dim=1)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        out = attend(q, k, v, self.layer_index).reshape(num_tokens, -1)
        return self.o_proj(out if rows is None else out[rows])


def activation(name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    from transformers.activations import ACT2FN

    return F.silu if name == "silu" else ACT2FN[name]


class MLP(nn.Module):
    def __init__(self, config, activation_name: str = "silu", intermediate_size: int | None = None):
        super().__init__()
        size = intermediate_size or config.intermediate_size
        self.gate_up_proj = nn.Linear(config.hidden_size, 2 * size, bias=False)
        self.down_proj = nn.Linear(size, config.hidden_size, bias=False)
        self.activation_name = activation_name  # the C++ gated kernel computes SiLU only (cpu_linear.py)
        self.act = activation(activation_name)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class ExpertWeights(nn.Module):
    """Every routed expert's projections stacked, [experts, out, in] (gate and up fused, gate first)."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class MixtureOfExperts(nn.Module):
    """Routed experts (top-k of a softmax router) and, in Qwen2-MoE, a shared expert behind a sigmoid gate.

    The experts' weights are stacked ([experts, out, in], transformers' own layout), and a step's
    (token, expert) pairs are sorted by expert so that two grouped matmuls compute every active expert at
    once, instead of a loop of small matmuls per expert (``python -m benchmarks.moe_experts`` compares them;
    the figures: docs/engine.md)."""

    def __init__(self, config, arch: Architecture):
        super().__init__()
        experts = arch.experts
        self.num_experts, self.top_k, self.normalize_top_k = experts.num_experts, experts.top_k, experts.normalize_top_k
        self.gate = nn.Linear(config.hidden_size, experts.num_experts, bias=False)
        self.experts = ExpertWeights(experts.num_experts, config.hidden_size, experts.intermediate_size)
        self.act = activation(arch.activation)
        if experts.shared_intermediate_size:
            self.shared_expert = MLP(config, arch.activation, experts.shared_intermediate_size)
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Each token's experts and their weights, [tokens, top_k] each (transformers' arithmetic)."""
        probs = torch.softmax(self.gate(x), dim=-1, dtype=torch.float)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize_top_k:
            weights /= weights.sum(dim=-1, keepdim=True)
        return chosen, weights.to(x.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        chosen, weights = self.route(x)
        out = grouped_experts(x, chosen, weights, self.experts.gate_up_proj, self.experts.down_proj, self.act)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def grouped_experts(x, chosen, weights, gate_up, down, act) -> torch.Tensor:
    """sum over each token's chosen experts e of weight * down[e](act(gate[e] x) * up[e] x), pairs grouped by expert."""
    num_tokens, top_k = chosen.shape
    by_expert = chosen.flatten().argsort(stable=True)  # stable: each token's experts summed in expert order, as HF
    tokens = by_expert // top_k
    ends = torch.bincount(chosen.flatten(), minlength=gate_up.shape[0]).cumsum(0).to(torch.int32)
    gate, up = F.grouped_mm(x[tokens], gate_up.transpose(1, 2), offs=ends).chunk(2, dim=-1)
    out = F.grouped_mm(act(gate) * up, down.transpose(1, 2), offs=ends)
    out = out * weights.flatten()[by_expert, None]
    return torch.zeros_like(x).index_add_(0, tokens, out)


def looped_experts(x, chosen, weights, gate_up, down, act) -> torch.Tensor:
    """The same sum as grouped_experts, one expert at a time (transformers' way): the reference it is measured against."""
    out = torch.zeros_like(x)
    for expert in chosen.unique().tolist():
        tokens, slot = torch.where(chosen == expert)
        gate, up = F.linear(x[tokens], gate_up[expert]).chunk(2, dim=-1)
        out.index_add_(0, tokens, F.linear(act(gate) * up, down[expert]) * weights[tokens, slot, None])
    return out


class DecoderLayer(nn.Module):
    def __init__(self, config, arch: Architecture, layer_index: int):
        super().__init__()
        eps = config.rms_norm_eps
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = Attention(config, arch, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        # Gemma's sandwich: post_attention_layernorm normalises the attention's output, these the MLP's input and output.
        self.pre_feedforward_layernorm = RMSNorm(config.hidden_size, eps) if arch.sandwich_norms else None
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, eps) if arch.sandwich_norms else None
        sparse = arch.experts is not None and layer_index in arch.experts.sparse_layers
        self.mlp = MixtureOfExperts(config, arch) if sparse else MLP(config, arch.activation)

    def forward(self, x, rope, attend: Attend, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Every token's output, or only `rows`' (the last layer's, where only some tokens' logits are wanted)."""
        attended = self.self_attn(self.input_layernorm(x), rope, attend, rows)
        x = x if rows is None else x[rows]
        if self.pre_feedforward_layernorm is None:
            x = x + attended
            return x + self.mlp(self.post_attention_layernorm(x))
        x = x + self.post_attention_layernorm(attended)
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class DecoderModel(nn.Module):
    def __init__(self, config, arch: Architecture, max_len: int):
        super().__init__()
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(config, arch, i) for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config, max_len)


def rows_to_finish(input_ids: torch.Tensor, logit_rows: torch.Tensor | None) -> torch.Tensor:
    """The rows the last layer finishes: those whose logits are wanted, or (none wanted: a prompt's chunk)
    the last token's alone, so that a compiled graph never sees an empty dimension."""
    if logit_rows is not None:
        return logit_rows
    return torch.full((1,), input_ids.shape[0] - 1, dtype=torch.long, device=input_ids.device)


class CausalLM(nn.Module):
    # HF parameter names that we store fused: ours -> its parts, in concatenation order (a checkpoint that
    # stores them fused already, as Phi-3's, is read as is).
    packed_modules = {
        "qkv_proj": ("q_proj", "k_proj", "v_proj"),
        "gate_up_proj": ("gate_proj", "up_proj"),
    }

    def __init__(self, config, max_len: int):
        super().__init__()
        self.config = config
        self.architecture = architecture_of(config)
        self.model = DecoderModel(config, self.architecture, max_len)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)
        if getattr(config, "tie_word_embeddings", False):
            self.lm_head.weight = self.model.embed_tokens.weight
        self.embedding_scale = self.architecture.embedding_scale
        self.final_softcap = self.architecture.final_softcap

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
        rope = self.model.rotary(positions)
        x = self.model.embed_tokens(input_ids)
        if self.embedding_scale is not None:
            x = x * self.embedding_scale  # a Python float: rounded to x's dtype, as transformers rounds it
        *layers, last = self.model.layers
        for layer in layers:
            x = layer(x, rope, attend)
        return last(x, rope, attend, rows)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The vocabulary-wide head over the decoder's rows (the tokens whose next-token logits are wanted)."""
        logits = self.lm_head(self.head_input(hidden)).float()
        if self.final_softcap is not None:  # monotonic: the greedy head's argmax over the raw head stays right
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def head_input(self, hidden: torch.Tensor) -> torch.Tensor:
        """What the head multiplies: the decoder's rows after the final norm (also the greedy head's input)."""
        return self.model.norm(hidden)

    def paged_attention(self, meta: AttentionMetadata) -> Attend:
        """Each layer's attention over its own cache, for one step's metadata."""
        attentions = [layer.self_attn for layer in self.model.layers]  # a ModuleList's indexing costs microseconds

        def attend(q, k, v, layer_index: int) -> torch.Tensor:
            attn = attentions[layer_index]
            return paged_attention(q, k, v, attn.k_cache, attn.v_cache, meta, attn.scale, attn.window, attn.softcap)

        return attend

