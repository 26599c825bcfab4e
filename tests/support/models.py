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


# Tiny random checkpoints of each family the engine runs (engines/builtin/families.py): SmolLM2's vocabulary (its
# tokenizer serves them), 2-3 layers, windows shorter than the test prompts so that the windows matter.
SHARED = dict(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=32, max_position_embeddings=2048, initializer_range=0.2,
              bos_token_id=1, eos_token_id=2, pad_token_id=2)


def tiny_family_config(family: str):
    """The transformers config of a tiny random ``family`` model (a key of TINY_FAMILIES)."""
    import transformers

    class_name, settings = TINY_FAMILIES[family]
    return getattr(transformers, class_name)(**{**SHARED, **settings})


def tiny_family_model(family: str):
    """A random transformers model of ``family``, seeded: the same weights in every process."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = tiny_family_config(family)
    model_class = getattr(transformers, TINY_FAMILIES[family][0].replace("TextConfig", "Config").replace("Config", "ForCausalLM"))
    return model_class(config)


def saved_tiny_family(family: str, directory, tokenizer_dir):
    """(``directory`` holding a tiny random ``family`` checkpoint with SmolLM2's tokenizer, transformers' model of it
    in eager attention: the one that soft-caps as Gemma 2 asks)."""
    import shutil

    from transformers import AutoModelForCausalLM

    tiny_family_model(family).save_pretrained(directory)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, directory)
    return directory, AutoModelForCausalLM.from_pretrained(directory, attn_implementation="eager").eval()


TINY_FAMILIES = {
    "qwen3": ("Qwen3Config", dict(tie_word_embeddings=True)),
    "mistral": ("MistralConfig", dict(sliding_window=24, tie_word_embeddings=False)),
    # Untied: with a tied head the scaled embedding of the last token dominates, and a random Gemma repeats it.
    "gemma2": ("Gemma2Config", dict(num_hidden_layers=3, sliding_window=12, query_pre_attn_scalar=24,
                                    attn_logit_softcapping=2.0, final_logit_softcapping=30.0, tie_word_embeddings=False)),
    "gemma3": ("Gemma3TextConfig", dict(num_hidden_layers=3, sliding_window=12, query_pre_attn_scalar=24,
                                        final_logit_softcapping=30.0, tie_word_embeddings=False,
                                        layer_types=["sliding_attention", "full_attention", "sliding_attention"],
                                        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                                            "rope_theta": 100000.0},
                                                         "sliding_attention": {"rope_type": "default",
                                                                               "rope_theta": 10000.0}})),
    "phi3": ("Phi3Config", dict(sliding_window=40, tie_word_embeddings=False, partial_rotary_factor=0.75,
                                # Past the pretraining length transformers rescales every position at once, the engine
                                # only those past it (as vLLM): the tests stay below it.
                                max_position_embeddings=4096, original_max_position_embeddings=128,
                                rope_parameters={"rope_type": "longrope", "rope_theta": 10000.0,
                                                 "short_factor": [1.0 + i / 24 for i in range(12)],
                                                 "long_factor": [2.0 + i / 12 for i in range(12)]})),
    "qwen3_moe": ("Qwen3MoeConfig", dict(moe_intermediate_size=64, num_experts=8, num_experts_per_tok=2,
                                         norm_topk_prob=True, tie_word_embeddings=True)),
    "qwen2_moe": ("Qwen2MoeConfig", dict(moe_intermediate_size=64, shared_expert_intermediate_size=96, num_experts=8,
                                         num_experts_per_tok=2, norm_topk_prob=False, tie_word_embeddings=False)),
}
