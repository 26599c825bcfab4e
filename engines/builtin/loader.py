"""Weights and tokenizer from an HF checkpoint directory (safetensors) or a GGUF file.

GGUF goes through transformers' own GGUF reader (it de-quantizes and undoes llama.cpp's q/k
permutation), so both sources arrive as an HF-named state dict, which is then mapped onto our
fused module tree.

transformers parses a GGUF slowly (mostly the tokenizer and metadata), so the first load
saves the result as a plain HF checkpoint (safetensors, config, tokenizer files) in a cache
directory, and later loads read that instead. The cache is keyed by the GGUF's name, size and
mtime, and written to a temporary directory that is renamed into place: engine processes
starting together never see a half-written cache.
"""

from __future__ import annotations

import hashlib
import itertools
import logging
import contextlib
import os
import shutil
import tempfile
from pathlib import Path
from typing import Iterator
from unittest import mock

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from engines.builtin.config import default_model_path
from engines.builtin.errors import UnsupportedArchitecture
from engines.builtin.families import checkpoint_refusal
from engines.builtin.model import CausalLM

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(dtype: str, device: str) -> str:
    """``dtype`` itself, or for "auto" bfloat16 where ``device`` computes it natively, else float32."""
    if dtype != "auto":
        return dtype
    from engines.builtin.cpu_linear import cpu_has_fast_bf16

    if device == "cpu":
        return "bfloat16" if cpu_has_fast_bf16() else "float32"
    return "bfloat16" if torch.cuda.is_bf16_supported() else "float32"


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


def cache_root() -> Path:
    return Path(os.environ.get("PARROT_CACHE_DIR") or Path.home() / ".cache" / "parrot")


_FINGERPRINT_BYTES = 2**20


def gguf_cache_dir(source: ModelSource) -> Path:
    """Named by the file's content, not its path or mtime: every reinstall of a package that ships the
    GGUF (a fresh venv, a CI clone) made a new 500 MB cache when the key held the mtime. The size and a
    hash of its first and last MiB (header and metadata, last tensors) tell GGUF files apart at once,
    where hashing a multi-GB file would cost seconds at every start."""
    gguf = Path(source.directory, source.gguf_file)
    size = gguf.stat().st_size
    digest = hashlib.blake2b(digest_size=8)
    with gguf.open("rb") as file:
        digest.update(file.read(_FINGERPRINT_BYTES))
        file.seek(max(0, size - _FINGERPRINT_BYTES))
        digest.update(file.read(_FINGERPRINT_BYTES))
    return cache_root() / f"{gguf.stem}-{size}-{digest.hexdigest()}"


def converted_gguf(source: ModelSource) -> Path | None:
    """The GGUF's cache directory, converting it on first use; None if it cannot be written."""
    target = gguf_cache_dir(source)
    if target.is_dir():  # only ever appears complete, by rename
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    except OSError as exc:
        log.warning("not caching the converted GGUF (%s); every start will parse it again", exc)
        return None
    try:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        log.info("de-quantizing %s once into %s", source.gguf_file, target)
        AutoTokenizer.from_pretrained(source.directory, **source.hf_kwargs()).save_pretrained(staging)
        hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs())
        config = hf_model.config
        if hasattr(config, "quantization_config"):  # the cache holds plain floats
            del config.quantization_config
        config.save_pretrained(staging)
        state = hf_model.state_dict()
        if getattr(hf_model.config, "tie_word_embeddings", False):
            state.pop("lm_head.weight", None)  # one storage under two names: safetensors wants one
        save_file({name: tensor.contiguous() for name, tensor in state.items()}, staging / "model.safetensors")
        staging.chmod(0o755)  # mkdtemp makes it private
        try:
            staging.rename(target)
        except OSError:
            if not target.is_dir():  # else another process got there first with the same files
                raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def cached_source(source: ModelSource) -> ModelSource:
    """``source`` itself, or for a GGUF its converted cache when it can have one."""
    if source.gguf_file:
        cache = gguf_cache_dir(source)
        # The converted cache's config.json says as much as the GGUF's header, which the gguf package reads by
        # parsing every field (the whole vocabulary: seconds); the header is read only before the first conversion,
        # before transformers parses all of it, which would fail with its own words.
        refusal = checkpoint_refusal(str(cache) if cache.is_dir() else str(Path(source.directory, source.gguf_file)))
        if refusal:
            raise UnsupportedArchitecture(refusal)
        converted = converted_gguf(source)
        if converted is not None:
            return ModelSource(str(converted))
    return source


def load_tokenizer(source: ModelSource):
    from transformers import AutoTokenizer

    source = cached_source(source)
    return AutoTokenizer.from_pretrained(source.directory, **source.hf_kwargs())


def load_checkpoint(source: ModelSource) -> tuple[object, dict[str, torch.Tensor]]:
    """The HF config and HF-named float weights. An uncached GGUF file is parsed once, for both."""
    source = cached_source(source)
    if source.gguf_file:
        from transformers import AutoModelForCausalLM

        log.info("de-quantizing %s", source.gguf_file)
        hf_model = AutoModelForCausalLM.from_pretrained(source.directory, dtype=torch.float32, **source.hf_kwargs())
        return hf_model.config, hf_model.state_dict()
    from transformers import AutoConfig

    refusal = checkpoint_refusal(source.directory)
    if refusal:  # before its weights are read, and before transformers' AutoConfig, which knows fewer names
        raise UnsupportedArchitecture(refusal)
    files = sorted(Path(source.directory).glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors in {source.directory}")
    state: dict[str, torch.Tensor] = {}
    for file in tqdm(files, desc="loading safetensors", disable=len(files) < 2):
        state.update(load_file(file))
    config = AutoConfig.from_pretrained(source.directory)
    if config.model_type in MULTIMODAL_WRAPPERS:
        return language_model_of(config, state)
    return config, state


# Multimodal checkpoints whose language model the engine serves alone (text in, text out), by the prefixes their
# language model's weights carry (the Hub's and transformers 5's layouts).
MULTIMODAL_WRAPPERS = {"gemma3": ("language_model.model.", "model.language_model.")}


def language_model_of(config, state: dict[str, torch.Tensor]) -> tuple[object, dict[str, torch.Tensor]]:
    """The text config and the language model's weights under a plain causal LM's names; the vision tower dropped."""
    prefixes = MULTIMODAL_WRAPPERS[config.model_type]
    text_config = config.text_config
    text_config.tie_word_embeddings = getattr(config, "tie_word_embeddings", text_config.tie_word_embeddings)
    language = {}
    for name, tensor in state.items():
        for prefix in prefixes:
            if name.startswith(prefix):
                language["model." + name.removeprefix(prefix)] = tensor
        if name.endswith("lm_head.weight"):
            language["lm_head.weight"] = tensor
    return text_config, language


def fuse_state_dict(hf_state: dict[str, torch.Tensor], model: CausalLM) -> dict[str, torch.Tensor]:
    """Maps HF names onto ours: the parts of each fused projection concatenated (unless the checkpoint stores it
    fused, as Phi-3's), each expert's projections stacked, Gemma's norm weights w stored as the (1 + w) they scale by."""
    state = {}
    for name in model.state_dict():
        if name in hf_state:
            state[name] = hf_state[name]
        elif ".experts." in name:
            state[name] = stacked_experts(hf_state, name)
        else:
            for fused, parts in model.packed_modules.items():
                if f".{fused}." in name:
                    state[name] = torch.cat([hf_state[name.replace(fused, part)] for part in parts])
                    break
    if "lm_head.weight" not in state:  # tied checkpoints often omit the head
        state["lm_head.weight"] = state["model.embed_tokens.weight"]
    offset = model.architecture.norm_offset
    if offset:
        for name in state:
            if name.endswith("norm.weight"):
                state[name] = state[name].float() + offset
    return state


def stacked_experts(hf_state: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """``...mlp.experts.gate_up_proj`` or ``down_proj`` [experts, out, in] from a checkpoint's per-expert linears."""
    prefix, projection = name.rsplit(".", 1)
    parts = ("gate_proj", "up_proj") if projection == "gate_up_proj" else (projection,)
    stacked = []
    for expert in itertools.count():
        if f"{prefix}.{expert}.{parts[0]}.weight" not in hf_state:
            break
        stacked.append(torch.cat([hf_state[f"{prefix}.{expert}.{part}.weight"] for part in parts]))
    return torch.stack(stacked)


# The initialisers torch's modules call in their constructors (Linear, Embedding): the checkpoint's tensors replace theirs.
WEIGHT_INITS = ("normal_", "uniform_", "kaiming_uniform_", "zeros_", "ones_")


@contextlib.contextmanager
def no_weight_init() -> Iterator[None]:
    """Modules built without their random initialisation, as transformers' `no_init_weights` does: the checkpoint's
    tensors replace them (``assign=True``), so their own are left as allocated and never touched, hence never paged
    in. Not on the meta device: there torch's ops go through torch._refs, whose first call imports dynamo and
    inductor, about 2 s of an eager engine's start."""
    with contextlib.ExitStack() as stack:
        for name in WEIGHT_INITS:
            stack.enter_context(mock.patch.object(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor))
        yield


def build_model(config, hf_state: dict[str, torch.Tensor], dtype: str, max_len: int) -> CausalLM:
    with no_weight_init():
        model = CausalLM(config, max_len)
    state = fuse_state_dict(hf_state, model)
    model.load_state_dict(state, strict=True, assign=True)
    if getattr(config, "tie_word_embeddings", False):
        model.lm_head.weight = model.model.embed_tokens.weight
    model.to(DTYPES[dtype])
    model.eval()
    log.info("built %s model (%.1fM parameters)", dtype, sum(p.numel() for p in model.parameters()) / 1e6)
    return model
