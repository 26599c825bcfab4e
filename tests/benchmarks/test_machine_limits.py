"""benchmarks/machine_limits.py: the work a decode step and a prefill token cost, which the engine benchmark divides
by the machine's limits, counted from the config the same as the engine's model holds it."""

import os
import time

import pytest
import torch
from torch import nn

from benchmarks import machine_limits
from benchmarks.machine_limits import STORED_BITS, MachineLimits, ModelCost, best_of, compute_dtype, measure
from engines.builtin.cpu_linear import cpu_has_fast_bf16
from engines.builtin.core import on_a_passing_thread
from engines.builtin.model import CausalLM
from tests.support.models import tiny_llama_config


def test_the_cost_counts_every_weight_the_model_reads():
    config = tiny_llama_config()
    with torch.device("meta"):  # shapes alone
        model = CausalLM(config, max_len=64)
    decoder = sum(module.weight.numel() for module in model.model.layers.modules() if isinstance(module, nn.Linear))
    cost = ModelCost.of(config)
    assert cost.decoder_weights == decoder
    assert cost.head_weights == model.lm_head.weight.numel()
    assert cost.decode_step_bytes(16, 16) == 2 * (decoder + cost.head_weights)
    # int4: Q4_1's 5 bits a decoder weight (4-bit codes, an fp16 scale and minimum per 32), the head Q8_0's 8.5
    assert cost.decode_step_bytes(*STORED_BITS["int4"]) == (5 * decoder + 8.5 * cost.head_weights) / 8
    # a 1,000-token prompt: each token attends to 500 others on average, 4 FLOPs a head dimension (scores, values)
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * 500
    assert cost.prefill_flops_per_token(1000) == 2 * decoder + attention


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in Linux's /proc")
def test_measuring_leaves_the_calling_thread_as_it_was(monkeypatch):
    """Neither the caller's torch thread count nor OpenMP workers of its own: an idle set of them beside the
    engine's step thread slows every step (machine_limits.measure). Small sizes: the threads are the point here,
    not the figures."""
    monkeypatch.setattr(machine_limits, "STREAM_BYTES", 1 << 24)
    monkeypatch.setattr(machine_limits, "GEMM_SIZE", 256)

    def thread_count() -> int:
        return len(os.listdir("/proc/self/task"))

    def caller():  # a thread that has never run a parallel op, as the engine's step thread expects the others
        threads, before = torch.get_num_threads(), thread_count()
        limits = measure(torch.float32, threads=1 if threads > 1 else 2)
        measure(torch.float32, threads=2)
        # A thread that ends tells its workers to exit and does not wait for them: give them time to go.
        deadline = time.monotonic() + 30
        while thread_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        return limits, threads, torch.get_num_threads(), thread_count() - before

    on_a_passing_thread(lambda: measure(torch.float32, threads=2))  # torch's once-per-process threads made first
    limits, threads_before, threads_after, left_behind = on_a_passing_thread(caller)
    assert threads_after == threads_before, "the benchmark's own threads must not change under it"
    # (fewer is fine: an earlier measurement's workers may still have been leaving when this one began)
    assert left_behind <= 0, "measuring left threads behind: the caller's own OpenMP workers"
    assert 0 < limits.stream_gb_s < float("inf") and 0 < limits.gemm_gflop_s < float("inf")


def test_the_best_of_several_measurements_takes_each_limit_at_its_highest():
    slow_read = MachineLimits(threads=2, dtype="bfloat16", stream_gb_s=10.0, gemm_gflop_s=900.0)
    slow_gemm = MachineLimits(threads=2, dtype="bfloat16", stream_gb_s=20.0, gemm_gflop_s=300.0)
    assert best_of([slow_read, slow_gemm]) == MachineLimits(threads=2, dtype="bfloat16", stream_gb_s=20.0, gemm_gflop_s=900.0)


def test_bf16_is_bounded_by_the_dtype_the_cpu_computes_it_in():
    """Where the CPU has no bf16 dot product its bf16 products run in fp32 (torch's bf16 mm there is a reference
    loop, no limit of the machine's): the prefill fraction is over fp32's GEMM."""
    assert compute_dtype(torch.float32) == torch.float32
    assert compute_dtype(torch.bfloat16) == (torch.bfloat16 if cpu_has_fast_bf16() else torch.float32)
