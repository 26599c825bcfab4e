"""Weights and tokenizer from an HF checkpoint directory (safetensors) or a GGUF file.

GGUF goes through transformers' own GGUF reader (it de-quantizes and undoes llama.cpp's q/k
permutation), so both sources arrive as an HF-named state dict, which is then mapped onto our
fused module tree.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from safetensors.torch import load_file
from tqdm import tqdm

from engines.builtin.config import default_model_path
from engines.builtin.model import LlamaForCausalLM, RotaryEmbedding

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class ModelSource:
    """Where the weights and tokenizer live: a directory, and a GGUF file name inside it or None."""

    def __init__(self, model: str | None):
        path = Path(model or default_model_path())
        if path.suffix == ".gguf":
            self.directory, self.gguf_file = str(path.parent), path.name
        else:
            self.directory, self.gguf_file = str(path), None
        self.name = path.stem if self.gguf_file else path.name

    def hf_kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.directory, **source.hf_kwargs())


def load_checkpoint(source: ModelSource) -> tuple[object, dict[str, torch.Tensor]]:
    """The HF config and HF-named float weights. A GGUF file is parsed once, for both."""
    if source.gguf_file:
        from transformers import AutoModelForCausalLM

        log.info("de-quantizing %s", source.gguf_file)
        hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs())
        return hf_model.config, hf_model.state_dict()
    from transformers import AutoConfig

    files = sorted(Path(source.directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {source.directory}")
    state: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc="loading safetensors", disable=len(files) < 2):
        state.update(load_file(file))
    return AutoConfig.from_pretrained(source.directory), state


def fuse_state_dict(hf_state: dict[str, torch.Tensor], model: LlamaForCausalLM) -> dict[str, torch.Tensor]:
    """Maps HF names onto ours, concatenating the parts of each fused projection."""
    state = {}
    for name in model.state_dict():
        for fused, parts in model.packed_modules.items():
            if f".{fused}." in name:
                state[name] = torch.cat([hf_state[name.replace(fused, part)] for part in parts])
                break
        else:
            if name in hf_state:
                state[name] = hf_state[name]
    if "lm_head.weight" not in state:  # tied checkpoints often omit the head
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def build_model(config, hf_state: dict[str, torch.Tensor], dtype: str, max_len: int) -> LlamaForCausalLM:
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_len)
    state = fuse_state_dict(hf_state, model)
    model.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    # The rope table is computed, not loaded: build it for real after the meta construction.
    model.model.rotary = RotaryEmbedding(config, max_len)
    model.to(DTYPES[dtype])
    model.eval()
    log.info("built %s model (%.1fM parameters)", dtype, sum(p.numel() for p in model.parameters()) / 1e6)
    return model
