"""The models tests run: the real default one (SmolLM2, by its served name) and a tiny random Llama's config."""

from __future__ import annotations

SMOLLM = "SmolLM2-135M-Instruct"


def tiny_llama_config(**overrides):
    from transformers import LlamaConfig

    # SmolLM2's head geometry (head_dim 64, 9:3 GQA) and vocabulary, 2 layers. A wide init makes
    # the random model's greedy choices vary from token to token, so identity checks can fail.
    settings = dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=2,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        initializer_range=0.2,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    settings.update(overrides)
    return LlamaConfig(**settings)
