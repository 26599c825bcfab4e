"""benchmarks/engine_throughput.py: which columns its fractions of the machine's limits are computed for, and how."""

import argparse

import pytest

from benchmarks.engine_throughput import REFERENCE, FreshPrompts, at_dtype, fractions_of_limit, quantized
from benchmarks.machine_limits import STORED_BITS, MachineLimits, ModelCost


def test_fractions_only_for_columns_whose_weights_are_at_the_dtype():
    """A fraction counts --dtype's weight bytes: quantized columns and a --compare-url server (its format its own,
    as llama.cpp's Q4_1) get none; a vLLM the benchmark started runs at --dtype and gets one."""
    columns = dict.fromkeys(["ours-float32", "ours-int4", "ours-int4-compiled", "ours-int8", "llama.cpp", "hf", *REFERENCE])
    compared = argparse.Namespace(compare_name="llama.cpp", start_vllm=None)
    assert at_dtype(columns, compared) == ["ours-float32", "hf"]
    started = argparse.Namespace(compare_name="vllm-cpu-bf16", start_vllm="VENV/bin/python")
    assert at_dtype(dict.fromkeys(["ours-bfloat16", "vllm-cpu-bf16"]), started) == ["ours-bfloat16", "vllm-cpu-bf16"]


def test_quantized_columns_count_their_stored_bytes():
    """Our int8 and int4 columns (eager or compiled) get decode fractions at their weights' stored bits, no other column."""
    columns = dict.fromkeys(["ours-float32", "ours-int4", "ours-int4-compiled", "ours-int8", "llama.cpp", "hf"])
    int4, int8 = STORED_BITS["int4"], STORED_BITS["int8"]
    assert quantized(columns) == {"ours-int4": int4, "ours-int4-compiled": int4, "ours-int8": int8}


@pytest.mark.model  # SmolLM2's config, from its GGUF
def test_a_quantized_columns_decode_fraction_is_its_stored_bytes_over_the_read():
    """SmolLM2 (the default model): an int4 stream of 10 tok/s reads 10 x Q4_1's step bytes a second; its prefill,
    integer products, gets no fraction of the float GEMM, where the fp32 column's does."""
    from transformers import AutoConfig

    from engines.builtin.loader import ModelSource, cached_source

    source = cached_source(ModelSource(None))
    cost = ModelCost.of(AutoConfig.from_pretrained(source.directory, **source.hf_kwargs()))
    prefill = FreshPrompts.__new__(FreshPrompts)  # its prompts alone: no tokenizer needed
    prefill[:] = [[1] * 1000]
    loads = {"single": ([[1, 2, 3]], None), "prefill": (prefill, None)}
    columns = {"ours-int4-compiled": {"single": 10.0, "prefill": 500.0}, "ours-float32": {"single": 10.0, "prefill": 500.0}}
    limit = MachineLimits(threads=2, stream_gb_s=1.0, gemm_gflop_s=100.0, dtype="float32")
    fractions = fractions_of_limit(columns, loads, limit, argparse.Namespace(model=None, dtype="float32"))
    assert fractions["ours-int4-compiled"] == {"single": 10 * cost.decode_step_bytes(*STORED_BITS["int4"]) / 1e9}
    assert fractions["ours-float32"]["single"] == 10 * cost.decode_step_bytes(32, 32) / 1e9
    assert fractions["ours-float32"]["prefill"] == 500 * cost.prefill_flops_per_token(1000) / 1e9 / 100
