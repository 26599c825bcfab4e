"""benchmarks/engine_throughput.py: which columns its fractions of the machine's limits are computed for."""

import argparse

from benchmarks.engine_throughput import REFERENCE, at_dtype


def test_fractions_only_for_columns_whose_weights_are_at_the_dtype():
    """A fraction counts --dtype's weight bytes: quantized columns and a --compare-url server (its format its own,
    as llama.cpp's Q4_1) get none; a vLLM the benchmark started runs at --dtype and gets one."""
    columns = dict.fromkeys(["ours-float32", "ours-int4", "ours-int4-compiled", "ours-int8", "llama.cpp", "hf", *REFERENCE])
    compared = argparse.Namespace(compare_name="llama.cpp", start_vllm=None)
    assert at_dtype(columns, compared) == ["ours-float32", "hf"]
    started = argparse.Namespace(compare_name="vllm-cpu-bf16", start_vllm="VENV/bin/python")
    assert at_dtype(dict.fromkeys(["ours-bfloat16", "vllm-cpu-bf16"]), started) == ["ours-bfloat16", "vllm-cpu-bf16"]
