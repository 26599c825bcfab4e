"""Every family the engine runs, as a tiny random checkpoint built here (no downloads; SmolLM2's tokenizer):
greedy output token-identical to transformers' generate at fp32 (up to near ties, test_core_generation.Greedy),
for a mixed batch under chunked prefill and preemption, and for forks of one shared prefix. The windows of the
tiny configs are shorter than the prompts, so windowed layers attend to part of their context."""

from __future__ import annotations

import asyncio
import shutil

import pytest
import torch

from engines.builtin.config import EngineConfig
from engines.builtin.core import EngineCore
from engines.builtin.model import architecture_of
from tests.engines.builtin.test_core_generation import GREEDY, assert_all_blocks_free, collect, hf_greedy, random_prompts
from tests.support.models import TINY_FAMILIES, saved_tiny_family, tiny_family_config, tiny_family_model
from tests.support.gguf_files import add_byte_level_tokenizer, byte_level_vocab

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module", params=sorted(TINY_FAMILIES))
def family(request, tmp_path_factory, smollm2_tokenizer_dir):
    """(checkpoint directory, transformers' model in eager attention: the one that soft-caps as Gemma 2 asks)."""
    return saved_tiny_family(request.param, tmp_path_factory.mktemp(f"tiny-{request.param}"), smollm2_tokenizer_dir)


def test_mixed_batch_under_chunked_prefill_and_preemption_matches_transformers(family):
    directory, hf_model = family
    # 10 blocks of 16 slots for prompts and outputs needing 12 (as test_core_generation's preemption test), and
    # a 24-token budget: prompts are cut into chunks, and sequences are evicted and recomputed. Where every layer
    # is windowed the blocks behind the windows are freed (test_sliding_window.py): 6 blocks and two more prompts, so
    # that they still are.
    windowed = architecture_of(hf_model.config).freeing_window is not None
    engine = EngineCore(EngineConfig(model=str(directory), num_blocks=6 if windowed else 10, max_num_batched_tokens=24))
    prompts = random_prompts((1, 9, 37, 70, *((50, 60) if windowed else ())), seed=3)
    outputs = engine.generate_batch(prompts, GREEDY)
    assert engine.scheduler.num_preemptions > 0
    for prompt, output in zip(prompts, outputs):
        assert hf_greedy(hf_model, prompt).accepts(output), f"prompt of {len(prompt)} tokens"
    assert_all_blocks_free(engine)
    engine.shutdown()


async def test_forks_of_a_shared_prefix_match_transformers(family):
    directory, hf_model = family
    engine = EngineCore(EngineConfig(model=str(directory)))
    prefix, *suffixes = random_prompts((37, 5, 16, 1), seed=2)  # 37: a partial last block to copy
    await forks_match_transformers(engine, hf_model, prefix, suffixes)


async def forks_match_transformers(engine: EngineCore, hf_model, prefix, suffixes, after_fill=lambda engine: None):
    """Fills ``prefix`` on the (started here) engine, forks it for each suffix, and checks each fork's greedy output
    against transformers' for prefix + suffix; ``after_fill(engine)`` once the prefix is filled. All freed after."""
    engine.start()
    try:
        parent = await engine.fill(prefix)
        after_fill(engine)
        children = [(await engine.fill(suffix, parent_context_id=parent.context_id)).context_id for suffix in suffixes]
        outputs = await asyncio.gather(*(collect(engine.generate(child, GREEDY)) for child in children))
        for suffix, output in zip(suffixes, outputs):
            assert hf_greedy(hf_model, prefix + suffix).accepts(output), f"suffix of {len(suffix)} tokens"
        for context_id in [parent.context_id, *children]:
            await engine.free_context(context_id)
        assert_all_blocks_free(engine)
    finally:
        engine.shutdown()


# Through transformers' GGUF reader, which every family's GGUF goes through the same way (loader.py); Gemma 2 is the
# one whose weights it changes (the norms' 1 + w) and whose tensor names differ most. Qwen3 passes too (add it
# here), but each GGUF costs over a minute of parsing on a busy 2-core host.
GGUF_ARCHITECTURES = {"gemma2": "GEMMA2", "qwen3": "QWEN3"}
GGUF_TESTED = ("gemma2",)


def write_family_gguf(path, family: str) -> None:
    """A tiny random ``family`` model as an F32 GGUF, named as llama.cpp's converter names it (Gemma's norms stored as
    the 1 + w they scale by), with a byte-level BPE vocabulary of its own."""
    import gguf
    import numpy as np
    import torch
    import transformers

    vocab = byte_level_vocab()
    config = tiny_family_config(family)
    # llama.cpp's Gemma 2 has no output tensor (the head is the embedding); transformers reads Qwen3's head_dim
    # from no GGUF key (its default, 128, is every Qwen3's).
    config.vocab_size, config.tie_word_embeddings = len(vocab), family.startswith("gemma")
    if family == "qwen3":
        config.head_dim = 128
    torch.manual_seed(0)
    model = getattr(transformers, type(config).__name__.replace("Config", "ForCausalLM"))(config)
    arch = getattr(gguf.MODEL_ARCH, GGUF_ARCHITECTURES[family])
    writer = gguf.GGUFWriter(str(path), gguf.MODEL_ARCH_NAMES[arch])
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(256)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(10000.0)
    if getattr(config, "sliding_window", None):
        writer.add_sliding_window(config.sliding_window)
    add_byte_level_tokenizer(writer, vocab)
    names = gguf.get_tensor_name_map(arch, config.num_hidden_layers)
    for name, tensor in model.state_dict().items():
        if name == "lm_head.weight" and config.tie_word_embeddings:
            continue
        value = tensor.float().numpy()
        if family.startswith("gemma") and name.endswith("norm.weight"):
            value = value + 1
        writer.add_tensor(names.get_name(name, try_suffixes=(".weight", ".bias")), value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.slow  # transformers parses each GGUF twice here (reference and engine), tens of seconds each
@pytest.mark.parametrize("family_name", GGUF_TESTED)
def test_a_gguf_of_the_family_matches_transformers_reading_it(family_name, tmp_path, monkeypatch):
    pytest.importorskip("gguf")
    from transformers import AutoModelForCausalLM

    monkeypatch.setenv("PARROT_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-{family_name}.gguf"
    write_family_gguf(path, family_name)
    hf_model = AutoModelForCausalLM.from_pretrained(tmp_path, gguf_file=path.name, dtype=torch.float32,
                                                    attn_implementation="eager").eval()
    engine = EngineCore(EngineConfig(model=str(path), max_num_batched_tokens=24))
    prompts = random_prompts((9, 37), seed=4, vocab_size=hf_model.config.vocab_size)
    for prompt, output in zip(prompts, engine.generate_batch(prompts, GREEDY)):
        assert hf_greedy(hf_model, prompt).accepts(output), f"prompt of {len(prompt)} tokens"
    engine.shutdown()


def test_grouped_experts_equal_the_per_expert_loop_with_idle_experts():
    import torch.nn.functional as F

    from engines.builtin.model import grouped_experts, looped_experts

    generator = torch.Generator().manual_seed(0)
    gate_up, down = torch.randn(6, 2 * 16, 24, generator=generator), torch.randn(6, 24, 16, generator=generator)
    x = torch.randn(5, 24, generator=generator)
    chosen = torch.tensor([[0, 3], [3, 0], [5, 3], [0, 5], [3, 5]])  # experts 1, 2 and 4 get no token
    weights = torch.rand(5, 2, generator=generator)
    torch.testing.assert_close(grouped_experts(x, chosen, weights, gate_up, down, F.silu),
                               looped_experts(x, chosen, weights, gate_up, down, F.silu))


@pytest.mark.model  # transformers' configs: importing transformers takes seconds
def test_an_architecture_the_engine_cannot_run_is_refused_by_name(tmp_path):
    from transformers import GPT2Config

    from engines.builtin.errors import UnsupportedArchitecture
    from engines.builtin.loader import ModelSource, load_checkpoint
    from engines.builtin.model import architecture_of

    with pytest.raises(UnsupportedArchitecture, match=r"model_type 'gpt2'.*it runs llama, .*gemma2"):
        architecture_of(GPT2Config())
    (tmp_path / "config.json").write_text('{"model_type": "mamba", "architectures": ["MambaForCausalLM"]}')
    with pytest.raises(UnsupportedArchitecture, match="MambaForCausalLM"):  # before looking for weights (none here)
        load_checkpoint(ModelSource(str(tmp_path)))


def test_a_gguf_of_an_architecture_the_engine_cannot_run_is_refused_from_its_header(tmp_path):
    gguf = pytest.importorskip("gguf")
    from engines.builtin.errors import UnsupportedArchitecture
    from engines.builtin.families import checkpoint_refusal
    from engines.builtin.loader import ModelSource, load_checkpoint

    path = tmp_path / "tiny-mamba.gguf"
    writer = gguf.GGUFWriter(str(path), "mamba")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    assert "a GGUF of architecture 'mamba'; it runs llama, " in checkpoint_refusal(str(path))
    with pytest.raises(UnsupportedArchitecture, match="'mamba'"):  # before transformers parses it
        load_checkpoint(ModelSource(str(path)))


@pytest.mark.parametrize("scheme", ["int8", "int4"])
@pytest.mark.model  # builds a tiny random Qwen2-MoE
def test_quantizing_a_mixture_of_experts_leaves_its_router_and_shared_gate(scheme):
    from torch import nn

    from engines.builtin.loader import build_model
    from engines.builtin.quantization import quantize_linears

    hf_model = tiny_family_model("qwen2_moe")
    model = build_model(hf_model.config, hf_model.state_dict(), "float32", 64)
    quantize_linears(model, scheme)
    moe = model.model.layers[0].mlp
    assert type(moe.gate) is nn.Linear and type(moe.shared_expert_gate) is nn.Linear
    assert type(moe.shared_expert.down_proj) is not nn.Linear and type(model.model.layers[0].self_attn.qkv_proj) is not nn.Linear


def test_a_gemma3_multimodal_checkpoint_serves_its_language_model(tmp_path, smollm2_tokenizer_dir):
    """Gemma 3 from 4B up ships as Gemma3ForConditionalGeneration: the engine serves its language model on text,
    as transformers' multimodal model generates from text alone."""
    from transformers import Gemma3Config, Gemma3ForConditionalGeneration, SiglipVisionConfig

    vision = SiglipVisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                image_size=28, patch_size=14)
    config = Gemma3Config(text_config=tiny_family_config("gemma3").to_dict(), vision_config=vision.to_dict(),
                          mm_tokens_per_image=4, boi_token_index=49000, eoi_token_index=49001,
                          image_token_index=49002)
    torch.manual_seed(0)
    Gemma3ForConditionalGeneration(config).save_pretrained(tmp_path)
    for item in smollm2_tokenizer_dir.iterdir():
        shutil.copy(item, tmp_path)
    hf_model = Gemma3ForConditionalGeneration.from_pretrained(tmp_path, attn_implementation="eager").eval()
    engine = EngineCore(EngineConfig(model=str(tmp_path), max_num_batched_tokens=24))
    prompts = random_prompts((9, 37), seed=5, vocab_size=49000)  # clear of the image tokens' ids
    for prompt, output in zip(prompts, engine.generate_batch(prompts, GREEDY)):
        assert hf_greedy(hf_model, prompt).accepts(output), f"prompt of {len(prompt)} tokens"
    engine.shutdown()
