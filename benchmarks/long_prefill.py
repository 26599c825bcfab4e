"""Prefill of one long prompt (16k tokens) on a tiny-but-wide random model with a 32k context: the engine's
peak memory and time, chunked as it serves (max_num_batched_tokens a step). A Llama-shaped config with a real
model's width (hidden 2,048, 16 query and 8 kv heads of 128, MLP 8,192) and few layers, so that the KV cache and the
activations of a chunk weigh as a real model's per layer do, without its weights. The KV cache is planned by bytes
from kv_cache_memory_fraction (engines/builtin/kv_capacity.py).

    python -m benchmarks.long_prefill                           # 16,384 tokens, 2 layers -> docs/benchmarks/long_prefill_16k.json
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.results_file import TRACKED, write_results

WIDE = dict(vocab_size=49152, hidden_size=2048, intermediate_size=8192, num_attention_heads=16, num_key_value_heads=8,
            head_dim=128, max_position_embeddings=32768, rms_norm_eps=1e-5, tie_word_embeddings=True, bos_token_id=1,
            eos_token_id=2, pad_token_id=2, rope_theta=500000.0)
# The test's shape: a real model's heads of 128 and its 32k context, a quarter of the width. The property it checks
# holds at any width (one head's 16k x 16k scores alone are 1 GiB), and its prefill takes seconds, not minutes.
NARROW = WIDE | dict(hidden_size=512, intermediate_size=2048, num_attention_heads=4, num_key_value_heads=2)
SHAPES = {"wide": WIDE, "narrow": NARROW}


def random_model_dir(directory: Path, shape: dict, layers: int) -> Path:
    """A random Llama of ``shape`` with ``layers`` layers and SmolLM2's tokenizer, saved as an HF checkpoint."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from engines.builtin.loader import ModelSource, cached_source

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape, num_hidden_layers=layers)).save_pretrained(directory)
    source = cached_source(ModelSource(None))
    AutoTokenizer.from_pretrained(source.directory, **source.hf_kwargs()).save_pretrained(directory)
    return directory


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def prefill(model_dir: Path, tokens: int, chunk: int, fraction: float) -> dict:
    """One prompt of ``tokens`` random ids filled, then one greedy token: peak RSS and times."""
    from engines.builtin.config import EngineConfig
    from engines.builtin.core import EngineCore
    from engines.builtin.types import SamplingParams

    engine = EngineCore(EngineConfig(model=str(model_dir), kv_cache_memory_fraction=fraction,
                                     max_num_batched_tokens=chunk))
    loaded_rss = peak_rss_bytes()
    prompt = torch.randint(3, WIDE["vocab_size"], (tokens,), generator=torch.Generator().manual_seed(0)).tolist()
    start = time.perf_counter()
    engine.generate_batch([prompt], SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
    seconds = time.perf_counter() - start
    stats = engine.stats()
    return {"prompt_tokens": tokens, "chunk_tokens": chunk, "seconds": round(seconds, 1),
            "prefill_tokens_per_s": round(tokens / seconds, 1), "peak_rss_gib": round(peak_rss_bytes() / 2**30, 2),
            "rss_after_load_gib": round(loaded_rss / 2**30, 2), "kv_blocks": stats.blocks_total,
            "max_model_len": engine.max_model_len}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="wide")
    parser.add_argument("--chunk", type=int, default=2048, help="max_num_batched_tokens")
    parser.add_argument("--kv-fraction", type=float, default=0.25, help="kv_cache_memory_fraction")
    parser.add_argument("--out", default=str(TRACKED / "long_prefill_16k.json"))
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as scratch:
        result = prefill(random_model_dir(Path(scratch), SHAPES[args.shape], args.layers), args.tokens, args.chunk,
                         args.kv_fraction)
    load = subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()
    config = {**SHAPES[args.shape], "shape": args.shape, "num_hidden_layers": args.layers, "dtype": "float32", "threads": torch.get_num_threads()}
    path = write_results(args.out, {"model": config, "result": result, "uptime": load,
                                    "note": "a shared host: other work ran beside it"})
    print(result, "->", path)


if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    main()
