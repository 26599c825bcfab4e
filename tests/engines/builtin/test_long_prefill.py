"""A 16k-token prompt on a random model with a 32k context prefills in chunks without running out of memory:
benchmarks/long_prefill.py run as its own process (its peak RSS is then the engine's alone), on its narrow shape (heads
of 128, a quarter of the width; the benchmark's own run takes the real width, docs/benchmarks/long_prefill_16k.json)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, pytest.mark.model, pytest.mark.timeout(600)]

# What the prefill may add to the loaded engine's memory: a 2,048-token chunk's activations and scratch. A prefill that
# held the whole prompt's scores (16k x 16k floats: 1 GiB a head, four heads) would add gigabytes.
PREFILL_RSS_GIB = 0.5


def test_a_16k_prompt_prefills_within_bounded_memory(tmp_path):
    out = tmp_path / "long_prefill.json"
    subprocess.run([sys.executable, "-m", "benchmarks.long_prefill", "--shape", "narrow", "--layers", "1",
                    "--kv-fraction", "0.02", "--out", str(out)],
                   check=True, timeout=500)
    result = json.loads(out.read_text())["result"]
    assert result["prompt_tokens"] == 16384 and result["max_model_len"] == 32768
    assert result["peak_rss_gib"] - result["rss_after_load_gib"] < PREFILL_RSS_GIB
