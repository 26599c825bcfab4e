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
)

# The exit status of an engine process that refused its model: the supervisor does not restart it (EX_CONFIG).
EXIT_UNSUPPORTED_MODEL = 78


def unsupported_reason(model_type: str | None, architectures: list[str] | None = None) -> str | None:
    """Why the engine cannot run a checkpoint of this type, or None when it can."""
    if model_type in SUPPORTED_MODEL_TYPES:
        return None
    named = f"{', '.join(architectures)} (model_type {model_type!r})" if architectures else f"model_type {model_type!r}"
    hint = " (Gemma 3's multimodal checkpoint: serve its text model, Gemma3ForCausalLM)" if model_type == "gemma3" else ""
    return (f"the builtin engine cannot run {named}{hint}; it runs {', '.join(SUPPORTED_MODEL_TYPES)}. "
            "Serve this model through an upstream engine (vLLM, SGLang) instead")


def checkpoint_refusal(model: str | None) -> str | None:
    """Why the engine would refuse the model at ``model`` (an HF directory), read from its config.json alone;
    None when it runs it, or when that cannot be told without transformers (a GGUF, no config.json): the engine
    refuses those itself when it loads them."""
    if not model:
        return None
    config_file = Path(model) / "config.json"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError):
        return None
    return unsupported_reason(config.get("model_type"), config.get("architectures"))
