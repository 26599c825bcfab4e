"""benchmarks/machine_limits.py: the work a decode step and a prefill token cost, which the engine benchmark divides
by the machine's limits, counted from the config the same as the engine's model holds it."""

import os
import threading
import time

import pytest
import torch
from torch import nn

from benchmarks.machine_limits import MachineLimits, ModelCost, best_of, measure
from engines.builtin.model import LlamaForCausalLM
from tests.conftest import tiny_llama_config


def test_the_cost_counts_every_weight_the_model_reads():
    config = tiny_llama_config()
    with torch.device("meta"):  # shapes alone
        model = LlamaForCausalLM(config, max_len=64)
    decoder = sum(module.weight.numel() for module in model.model.layers.modules() if isinstance(module, nn.Linear))
    cost = ModelCost.of(config)
    assert cost.decoder_weights == decoder
    assert cost.head_weights == model.lm_head.weight.numel()
    assert cost.decode_step_bytes(torch.bfloat16) == 2 * (decoder + cost.head_weights)
    # a 1,000-token prompt: each token attends to 500 others on average, 4 FLOPs a head dimension (scores, values)
    attention = 4 * config.num_hidden_layers * config.num_attention_heads * config.head_dim * 500
    assert cost.prefill_flops_per_token(1000) == 2 * decoder + attention


def test_measuring_leaves_torch_threads_as_they_were():
    before = torch.get_num_threads()
    # float32: torch's bf16 GEMM on a CPU without a bf16 dot product (AVX2) took minutes here
    limits = measure(torch.float32, threads=1 if before > 1 else 2)
    assert torch.get_num_threads() == before, "the benchmark's own threads must not change under it"
    assert 0 < limits.stream_gb_s < float("inf") and 0 < limits.gemm_gflop_s < float("inf")


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="counts threads in Linux's /proc")
def test_measuring_leaves_the_calling_thread_no_openmp_workers():
    """An idle set of OpenMP workers beside the engine's step thread slows every step (machine_limits.measure)."""

    def thread_count() -> int:
        return len(os.listdir("/proc/self/task"))

    left_behind = []

    def caller():  # a thread that has never run a parallel op, as the engine's step thread expects the others
        before = thread_count()
        measure(torch.float32, threads=2)
        # A thread that ends tells its workers to exit and does not wait for them: give them time to go.
        deadline = time.monotonic() + 30
        while thread_count() > before and time.monotonic() < deadline:
            time.sleep(0.05)
        left_behind.append(thread_count() - before)

    for work in (lambda: measure(torch.float32, threads=2), caller):  # first torch's threads made once per process
        thread = threading.Thread(target=work)
        thread.start()
        thread.join()
    # (fewer is fine: an earlier measurement's workers may still have been leaving when this one began)
    assert left_behind[0] <= 0, "measuring left threads behind: the caller's own OpenMP workers"


def test_the_best_of_several_measurements_takes_each_limit_at_its_highest():
    slow_read = MachineLimits(threads=2, dtype="bfloat16", stream_gb_s=10.0, gemm_gflop_s=900.0)
    slow_gemm = MachineLimits(threads=2, dtype="bfloat16", stream_gb_s=20.0, gemm_gflop_s=300.0)
    assert best_of([slow_read, slow_gemm]) == MachineLimits(threads=2, dtype="bfloat16", stream_gb_s=20.0, gemm_gflop_s=900.0)
