"""benchmarks/machine_limits.py: the work a decode step and a prefill token cost, which the engine benchmark divides
by the machine's limits, counted from the config the same as the engine's model holds it."""

import torch
from torch import nn

from benchmarks.machine_limits import ModelCost, measure
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


def test_the_limits_are_measured_on_the_threads_asked():
    limits = measure(torch.bfloat16, threads=1)
    assert limits.threads == 1 and limits.dtype == "bfloat16"
    assert limits.stream_gb_s > 0 and limits.gemm_gflop_s > 0
