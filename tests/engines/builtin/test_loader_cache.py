"""A GGUF is converted once into a cached HF checkpoint; later loads read the cache, and engines
starting together never see a half-written one."""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import numpy as np
import pytest
import torch

from engines.builtin import loader
from engines.builtin.loader import ModelSource, load_checkpoint, load_tokenizer
from tests.support.markers import marks_users
from tests.support.gguf_files import add_byte_level_tokenizer, byte_level_vocab

# Every test here loads a model (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = pytest.mark.model


def write_tiny_gguf(path: Path, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2) -> None:
    """A 2-layer Llama GGUF with random F32 tensors and a byte-level BPE vocabulary."""
    import gguf

    rng = np.random.default_rng(0)
    vocab = byte_level_vocab()
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_block_count(layers)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_feed_forward_length(2 * hidden)
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_rope_freq_base(10000.0)
    add_byte_level_tokenizer(writer, vocab)
    head_dim = hidden // heads
    shapes = {"token_embd.weight": (len(vocab), hidden), "output_norm.weight": (hidden,)}
    for i in range(layers):
        shapes |= {
            f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
            f"blk.{i}.attn_q.weight": (heads * head_dim, hidden), f"blk.{i}.attn_k.weight": (kv_heads * head_dim, hidden),
            f"blk.{i}.attn_v.weight": (kv_heads * head_dim, hidden), f"blk.{i}.attn_output.weight": (hidden, hidden),
            f"blk.{i}.ffn_gate.weight": (2 * hidden, hidden), f"blk.{i}.ffn_up.weight": (2 * hidden, hidden),
            f"blk.{i}.ffn_down.weight": (hidden, 2 * hidden),
        }
    for name, shape in shapes.items():
        writer.add_tensor(name, (rng.standard_normal(shape) * 0.1).astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture
@marks_users("model")  # a tiny GGUF, loaded through transformers
def tiny_gguf(tmp_path, monkeypatch) -> ModelSource:
    pytest.importorskip("gguf")
    write_tiny_gguf(tmp_path / "tiny.Q0.gguf")
    monkeypatch.setenv("PARROT_CACHE_DIR", str(tmp_path / "cache"))
    return ModelSource(str(tmp_path / "tiny.Q0.gguf"))


def gguf_reference(source: ModelSource):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs())
    return AutoTokenizer.from_pretrained(source.directory, **source.hf_kwargs()), model.state_dict()


def test_second_load_reads_the_cache_and_matches_the_gguf(tiny_gguf, monkeypatch):
    tokenizer, expected = gguf_reference(tiny_gguf)
    load_tokenizer(tiny_gguf)  # converts on first use
    cache = loader.gguf_cache_dir(tiny_gguf)
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name], "staging left behind"
    assert (cache / "model.safetensors").is_file() and (cache / "tokenizer.json").is_file()

    def no_gguf_parsing(*args, **kwargs):
        raise AssertionError("the GGUF was parsed again")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_gguf_parsing)
    config, state = load_checkpoint(tiny_gguf)
    assert config.num_hidden_layers == 2 and not hasattr(config, "quantization_config")
    expected.pop("lm_head.weight", None)  # tied: the loader takes the head from the embedding
    assert state.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(state[name], tensor), name
    cached_tokenizer = load_tokenizer(tiny_gguf)
    text = "the cat sat <|im_end|>"
    assert cached_tokenizer(text).input_ids == tokenizer(text).input_ids
    assert cached_tokenizer.eos_token_id == tokenizer.eos_token_id


def test_a_reinstalled_copy_reuses_the_cache_and_another_file_gets_its_own(tiny_gguf, tmp_path):
    """A fresh venv or CI clone installs the same GGUF anew (new path, new mtime): same cache."""
    original = Path(tiny_gguf.directory, tiny_gguf.gguf_file)
    (tmp_path / "reinstalled").mkdir()
    copy = tmp_path / "reinstalled" / original.name
    shutil.copyfile(original, copy)
    os.utime(copy, ns=(1, 1))
    changed = tmp_path / "changed" / original.name
    changed.parent.mkdir()
    data = bytearray(original.read_bytes())
    data[-1] ^= 0xFF  # the last tensor's last byte
    changed.write_bytes(bytes(data))

    same, other = loader.gguf_cache_dir(ModelSource(str(copy))), loader.gguf_cache_dir(ModelSource(str(changed)))

    assert same == loader.gguf_cache_dir(tiny_gguf)
    assert other != same


def take_turns_in_transformers(monkeypatch) -> None:
    """Threads stand in for engine processes, but transformers' loading is not thread-safe: while it loads it
    swaps process-wide functions (PreTrainedModel.tie_weights, torch.nn.init's, torch.linspace) and then puts
    back what it found, so two overlapping loads can leave the stand-ins in place for every later model (an
    untied head in another test's reference model), and two first imports of its lazy modules can collide.
    The loads take turns; both staging directories exist before either starts."""
    import transformers

    one_at_a_time = threading.Lock()
    for name in ("AutoTokenizer", "AutoModelForCausalLM"):
        load = getattr(transformers, name).from_pretrained

        def in_turn(*args, _load=load, **kwargs):
            with one_at_a_time:
                return _load(*args, **kwargs)

        monkeypatch.setattr(f"transformers.{name}.from_pretrained", in_turn)


def test_concurrent_first_loads_share_one_complete_cache(tiny_gguf, monkeypatch):
    # Both start converting before either finishes: each writes its own staging directory.
    barrier = threading.Barrier(2)
    convert = loader.tempfile.mkdtemp

    def mkdtemp_together(*args, **kwargs):
        path = convert(*args, **kwargs)
        barrier.wait(timeout=30)
        return path

    monkeypatch.setattr(loader.tempfile, "mkdtemp", mkdtemp_together)
    take_turns_in_transformers(monkeypatch)
    results, errors = [], []

    def load() -> None:
        try:
            results.append(load_checkpoint(tiny_gguf)[1])
        except Exception as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=load) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors, errors
    cache = loader.gguf_cache_dir(tiny_gguf)
    assert sorted(p.name for p in cache.parent.iterdir()) == [cache.name]
    assert all(torch.equal(results[0][name], results[1][name]) for name in results[0])


def test_unwritable_cache_falls_back_to_parsing_the_gguf(tiny_gguf, tmp_path, monkeypatch):
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    monkeypatch.setenv("PARROT_CACHE_DIR", str(blocker / "cache"))
    config, state = load_checkpoint(tiny_gguf)
    assert config.num_hidden_layers == 2 and "model.embed_tokens.weight" in state
