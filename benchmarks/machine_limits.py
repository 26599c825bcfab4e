"""What this machine allows a decode and a prefill, measured in the same run as the figures they bound.

    python -m benchmarks.machine_limits [--dtype bfloat16] [--threads 2]

  stream GB/s    a plain sum over 1 GiB (far past any cache): the rate a decode step's weight reads approach
  GEMM GFLOP/s   torch.mm of 2,048-square matrices in the dtype the CPU computes it in: the rate a prefill's
                 linears approach (the engine's own AMX kernel may pass torch's bf16 GEMM, and a fraction above 1
                 says so). bf16 on a CPU without a bf16 dot product is computed in fp32 (compute_dtype)

``engine_throughput`` reports each figure as a fraction of these (#20: "the fraction of the machine's limit it
reaches"): a decode step reads every weight once, so a decode workload's weight bytes per second over the
stream rate; a prefill token costs two FLOPs per decoder weight plus its causal attention, over the GEMM rate.
KV reads and the prompts' own compute in decode workloads are left out: the fractions are the weights' share.
"""

from __future__ import annotations

import argparse
import statistics
import time

import msgspec
import torch

from engines.builtin.core import on_a_passing_thread
from engines.builtin.cpu_linear import cpu_has_fast_bf16

STREAM_BYTES = 1 << 30
GEMM_SIZE = 2048


class MachineLimits(msgspec.Struct):
    threads: int
    stream_gb_s: float
    gemm_gflop_s: float  # in `dtype`
    dtype: str  # the GEMM's: the benchmark's, or what the CPU computes it in (compute_dtype)


# Bits a weight as the engine's quantized modes store it, (decoder linears, output head): GGUF's Q8_0 (8-bit codes and
# an fp16 scale per 32 inputs) for int8, and Q4_1 (4-bit codes, an fp16 scale and minimum per 32) with a Q8_0 head for
# int4 (engines/builtin/quantization.py).
STORED_BITS = {"int8": (8.5, 8.5), "int4": (5.0, 8.5)}


class ModelCost(msgspec.Struct):
    """A decoder's work per step and per token, from its HF config."""

    decoder_weights: int  # the decoder layers' linear weights
    head_weights: int  # the output head (read by every decode step, tied to the embedding or not)
    layers: int
    attention_width: int  # query heads x head size

    @classmethod
    def of(cls, hf_config) -> "ModelCost":
        hidden, heads = hf_config.hidden_size, hf_config.num_attention_heads
        head_dim = getattr(hf_config, "head_dim", None) or hidden // heads
        kv_width = hf_config.num_key_value_heads * head_dim
        per_layer = 2 * hidden * heads * head_dim + 2 * hidden * kv_width + 3 * hidden * hf_config.intermediate_size
        return cls(decoder_weights=per_layer * hf_config.num_hidden_layers, head_weights=hf_config.vocab_size * hidden,
                   layers=hf_config.num_hidden_layers, attention_width=heads * head_dim)

    def decode_step_bytes(self, decoder_bits: float, head_bits: float) -> float:
        """The bytes a decode step reads of the weights, stored at these bits a weight (STORED_BITS, or a dtype's)."""
        return (self.decoder_weights * decoder_bits + self.head_weights * head_bits) / 8

    def prefill_flops_per_token(self, prompt_tokens: float) -> float:
        """Linears plus causal attention (scores and weighted values over half the prompt on average)."""
        return 2 * self.decoder_weights + 4 * self.layers * self.attention_width * prompt_tokens / 2


def best_of(measured: list[MachineLimits]) -> MachineLimits:
    """Each limit at its highest over several measurements (a limit is what the machine reached at best)."""
    return MachineLimits(threads=measured[0].threads, dtype=measured[0].dtype,
                         stream_gb_s=max(m.stream_gb_s for m in measured), gemm_gflop_s=max(m.gemm_gflop_s for m in measured))


def median_seconds(call, repeats: int = 7) -> float:
    """The median wall time of ``repeats`` calls after one unmeasured call."""
    call()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def measure(dtype: torch.dtype, threads: int) -> MachineLimits:
    """The limits measured on a thread that then ends (core.on_a_passing_thread): torch's OpenMP workers live
    as long as the thread that started them, and an idle set of them beside the engine's step thread left the
    throttled spinning of libgomp (more of its threads than cores) on the step thread's: on a 2-core AMD EPYC
    a compiled fp32 engine in the same process then streamed one request at 22-31 tok/s instead of 40-48."""
    return on_a_passing_thread(lambda: _measure_here(dtype, threads), threads)


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype this CPU multiplies ``dtype`` in. Without a bf16 dot product (AVX2) bf16 products are fp32's: our
    kernel widens bf16 weights to fp32, and torch's bf16 mm there ran a reference loop (well under 1 GFLOP/s on an
    AMD EPYC, Zen 3), no limit of the machine's."""
    return torch.float32 if dtype == torch.bfloat16 and not cpu_has_fast_bf16() else dtype


def _measure_here(dtype: torch.dtype, threads: int) -> MachineLimits:
    data = torch.ones(STREAM_BYTES // 4)
    stream = STREAM_BYTES / median_seconds(data.sum) / 1e9
    del data
    dtype = compute_dtype(dtype)
    a, b = torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype), torch.randn(GEMM_SIZE, GEMM_SIZE).to(dtype)
    gemm = 2 * GEMM_SIZE**3 / median_seconds(lambda: torch.mm(a, b)) / 1e9
    return MachineLimits(threads=threads, stream_gb_s=stream, gemm_gflop_s=gemm, dtype=str(dtype).removeprefix("torch."))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    limits = measure(getattr(torch, args.dtype), args.threads)
    print(f"{limits.threads} threads: stream {limits.stream_gb_s:.1f} GB/s, {limits.dtype} GEMM {limits.gemm_gflop_s:.0f} GFLOP/s")


if __name__ == "__main__":
    main()
