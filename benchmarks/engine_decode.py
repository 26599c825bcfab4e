"""Builtin engine decode throughput, on CPU or CUDA, for the default model or a random Llama.

    python -m benchmarks.engine_decode --device cuda --random-config llama-1b
    python -m benchmarks.engine_decode --batch-sizes 1 16              # SmolLM2 on CPU
    python -m benchmarks.engine_decode --forks --prefix-lens 200 400 600

Decode mode: B requests with random 128-token prompts are prefilled, then `--steps` decode
steps are timed; prints decode tok/s (B tokens per step) and ms per step, medians of
`--repeats`. `--random-config` builds a Llama-family checkpoint with random weights from a
LlamaConfig preset (written once to a temp dir, with SmolLM2's tokenizer), so larger models run
without downloads.

Forks mode: 16 forks of one filled context decode together; steps alternate between the
shared-prefix kernel and plain paged decode, and the ratio of their step times is printed for
each prefix length (how CPU_MIN_SHARED_TOKENS in engines/builtin/model_runner.py was chosen).
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

from engines.builtin.config import EngineConfig  # noqa: E402
from engines.builtin.core import EngineCore  # noqa: E402
from engines.builtin.types import SamplingParams  # noqa: E402

# LlamaConfig keyword sets; geometry of the public models, weights random.
RANDOM_CONFIGS = {
    "smollm2-135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                         num_key_value_heads=3, head_dim=64, vocab_size=49152, rope_theta=100000.0),
    "llama-1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=64, vocab_size=128256, rope_theta=500000.0),
    "llama-3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256, rope_theta=500000.0),
}
GREEDY_FOREVER = SamplingParams(max_tokens=10**9, temperature=0.0, ignore_eos=True)


def random_checkpoint(preset: str) -> str:
    """An HF checkpoint dir for `preset` with random bf16 weights, made once per machine."""
    from safetensors.torch import save_file
    from transformers import AutoTokenizer, LlamaConfig

    from engines.builtin.config import default_model_path
    from engines.builtin.loader import ModelSource, load_tokenizer

    directory = Path(tempfile.gettempdir()) / f"parrot-random-{preset}"
    if (directory / "model.safetensors").exists():
        return str(directory)
    directory.mkdir(exist_ok=True)
    config = LlamaConfig(**RANDOM_CONFIGS[preset], max_position_embeddings=8192, tie_word_embeddings=True,
                         rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2)
    config.save_pretrained(directory)
    load_tokenizer(ModelSource(default_model_path())).save_pretrained(directory)
    AutoTokenizer.from_pretrained(directory)  # fail here, not in the engine, if it did not save
    generator = torch.Generator().manual_seed(0)
    hidden, head_dim, layers = config.hidden_size, config.head_dim, config.num_hidden_layers
    shapes = {"model.embed_tokens.weight": (config.vocab_size, hidden), "model.norm.weight": (hidden,)}
    for i in range(layers):
        prefix = f"model.layers.{i}"
        shapes |= {
            f"{prefix}.input_layernorm.weight": (hidden,),
            f"{prefix}.post_attention_layernorm.weight": (hidden,),
            f"{prefix}.self_attn.q_proj.weight": (config.num_attention_heads * head_dim, hidden),
            f"{prefix}.self_attn.k_proj.weight": (config.num_key_value_heads * head_dim, hidden),
            f"{prefix}.self_attn.v_proj.weight": (config.num_key_value_heads * head_dim, hidden),
            f"{prefix}.self_attn.o_proj.weight": (hidden, config.num_attention_heads * head_dim),
            f"{prefix}.mlp.gate_proj.weight": (config.intermediate_size, hidden),
            f"{prefix}.mlp.up_proj.weight": (config.intermediate_size, hidden),
            f"{prefix}.mlp.down_proj.weight": (hidden, config.intermediate_size),
        }
    weights = {
        name: (torch.ones(shape) if len(shape) == 1 else torch.randn(shape, generator=generator) * 0.02).to(torch.bfloat16)
        for name, shape in shapes.items()
    }
    save_file(weights, directory / "model.safetensors.partial")
    (directory / "model.safetensors.partial").rename(directory / "model.safetensors")
    return str(directory)


def prefilled_engine(engine: EngineCore, batch: int, prompt_len: int, seed: int = 0) -> None:
    """Starts `batch` endless greedy generations and steps until each has its first token."""
    generator = torch.Generator().manual_seed(seed)
    vocab = engine.runner.model.config.vocab_size
    for _ in range(batch):
        prompt = torch.randint(3, vocab, (prompt_len,), generator=generator).tolist()
        engine._start_generation(GREEDY_FOREVER, lambda event: None, None, prompt, None)
    while any(seq.num_generated_tokens == 0 for seq in engine.scheduler.running + engine.scheduler.waiting):
        engine.step()


def synchronize(engine: EngineCore) -> None:
    if engine.runner.device.type == "cuda":
        torch.cuda.synchronize()


def timed_steps(engine: EngineCore, steps: int) -> float:
    synchronize(engine)
    start = time.perf_counter()
    for _ in range(steps):
        engine.step()
    synchronize(engine)
    return (time.perf_counter() - start) / steps


def abort_all(engine: EngineCore) -> None:
    engine._abort_all()  # the generations are temporary contexts: their blocks go back


def bench_decode(config: EngineConfig, args) -> None:
    engine = EngineCore(config)
    print(f"model {engine.model_name}, device {config.device}, dtype {config.dtype}, "
          f"quantization {config.quantization}, "
          f"torch threads {torch.get_num_threads()}, median of {args.repeats}")
    print(f"{'batch':>6}{'decode tok/s':>15}{'ms/step':>10}")
    for batch in args.batch_sizes:
        prefilled_engine(engine, batch, args.prompt_len)
        timed_steps(engine, 2)  # warm-up: allocator, Triton autotune/compile
        seconds = statistics.median(timed_steps(engine, args.steps) for _ in range(args.repeats))
        print(f"{batch:6d}{batch / seconds:15.1f}{seconds * 1e3:10.2f}")
        abort_all(engine)


def bench_forks(config: EngineConfig, args) -> None:
    engine = EngineCore(config)
    runner = engine.runner
    print(f"16 forks decoding on {config.device}: step time with the shared-prefix kernel vs paged decode")
    print(f"{'prefix':>7}{'paged ms':>10}{'shared ms':>11}{'shared/paged':>14}")
    generator = torch.Generator().manual_seed(0)
    vocab = runner.model.config.vocab_size
    for prefix_len in args.prefix_lens:
        parent = engine._new_context(None, None)
        parent.token_ids += torch.randint(3, vocab, (prefix_len,), generator=generator).tolist()
        engine.scheduler.add(parent)
        while engine.scheduler.has_work():
            engine.step()
        for _ in range(16):
            suffix = torch.randint(3, vocab, (8,), generator=generator).tolist()
            engine._start_generation(GREEDY_FOREVER, lambda event: None, None, suffix, parent.context_id)
        engine.step()
        default = runner.min_shared_tokens
        times: dict[bool, list[float]] = {False: [], True: []}
        for round_ in range(2 * args.repeats):
            for shared in (False, True) if round_ % 2 else (True, False):  # interleaved: shared CPUs drift
                runner.min_shared_tokens = 0 if shared else 10**12
                times[shared].append(timed_steps(engine, 4))
        runner.min_shared_tokens = default
        paged, shared = statistics.median(times[False]), statistics.median(times[True])
        print(f"{prefix_len:7d}{paged * 1e3:10.1f}{shared * 1e3:11.1f}{shared / paged:14.3f}")
        abort_all(engine)
        engine.scheduler.contexts.pop(parent.context_id)
        engine.block_manager.release(parent)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--random-config", choices=sorted(RANDOM_CONFIGS), default=None,
                        help="random weights in this geometry instead of the default SmolLM2 GGUF")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 16, 64])
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--steps", type=int, default=32, help="decode steps per timing")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--quantization", default=None, choices=["int8", "int4"], help="CPU weight format")
    parser.add_argument("--kv-cache-gib", type=float, default=None, help="default: 8 on cuda, 0.5 on cpu")
    parser.add_argument("--forks", action="store_true", help="shared-prefix vs paged decode instead")
    parser.add_argument("--prefix-lens", type=int, nargs="+", default=[200, 400, 600])
    args = parser.parse_args()

    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit("engine_decode: --device cuda needs a CUDA GPU and a CUDA build of torch; "
                         f"this torch is {torch.__version__} and sees no GPU")
    cuda = args.device == "cuda"
    if args.random_config and not cuda:
        # Random weights drive some activations subnormal, which x86 computes ~20x slower.
        torch.set_flush_denormal(True)
    config = EngineConfig(
        model=random_checkpoint(args.random_config) if args.random_config else None,
        device=args.device,
        dtype=args.dtype or ("bfloat16" if cuda else "float32"),
        quantization=args.quantization,
        kv_cache_memory=int((args.kv_cache_gib or (8 if cuda else 0.5)) * 2**30),
        max_num_seqs=max(args.batch_sizes + [16]),
        max_num_batched_tokens=4096 if cuda else 1024,
    )
    (bench_forks if args.forks else bench_decode)(config, args)


if __name__ == "__main__":
    main()
