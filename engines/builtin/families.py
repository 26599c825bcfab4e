"""The model families the builtin engine runs, by transformers' ``model_type``, and the refusal of any other.

Torch-free on purpose: the gateway reads a model directory's config.json with it before it starts an engine
process, so that a checkpoint the engine cannot run stops ``parrot serve`` with its name at once instead of an
engine that fails at every restart. How each family's pieces differ: engines/builtin/model.py.
"""

from __future__ import annotations

import json
from pathlib import Path

SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "phi3", "qwen2_moe", "qwen3_moe",
    "gemma3",  # Gemma 3's multimodal checkpoints (4B and up): their language model alone (loader.language_model_of)
)

# llama.cpp's names for them in a GGUF's general.architecture (it writes Mistral's as "llama"), as transformers
# maps them.
GGUF_MODEL_TYPES = {
    "llama": "llama", "mistral": "mistral", "qwen2": "qwen2", "qwen3": "qwen3", "gemma2": "gemma2",
    "gemma3": "gemma3_text", "phi3": "phi3", "qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe",
}

# The exit status of an engine process that refused its model: the supervisor does not restart it (EX_CONFIG).
EXIT_UNSUPPORTED_MODEL = 78


def unsupported_reason(model_type: str | None, architectures: list[str] | None = None) -> str | None:
    """Why the engine cannot run a checkpoint of this type, or None when it can."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return None
    named = f"{', '.join(architectures)} (model_type {model_type!r})" if architectures else f"model_type {model_type!r}"
    return _refusal(named, SUPPORTED_MODEL_TYPES)


def _refusal(named: str, runs) -> str:
    return (f"the builtin engine cannot run {named}; it runs {', '.join(runs)}. "
            "Serve this model through an upstream engine (vLLM, SGLang) instead")


def checkpoint_refusal(model: str | None) -> str | None:
    """Why the engine would refuse the model at ``model`` (an HF directory or a GGUF file), read from its
    config.json or its GGUF header alone; None when it runs it, or when neither can be read (the load reports
    that itself)."""
    if not model:
        return None
    if model.endswith(".gguf"):
        architecture = gguf_architecture(Path(model))
        if architecture is None or architecture in GGUF_MODEL_TYPES:
            return None
        return _refusal(f"a GGUF of architecture {architecture!r}", GGUF_MODEL_TYPES)
    config_file = Path(model) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return unsupported_reason(config.get("model_type"), config.get("architectures"))


def gguf_architecture(path: Path) -> str | None:
    """The GGUF's general.architecture (its header only: the tensors are memory-mapped, not read)."""
    try:
        from gguf import GGUFReader

        field = GGUFReader(path).fields["general.architecture"]
        return bytes(field.parts[field.data[0]]).decode()
    except (ImportError, OSError, KeyError, ValueError):
        return None
