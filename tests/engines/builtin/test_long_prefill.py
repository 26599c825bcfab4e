"""A 16k-token prompt on a wide random model with a 32k context prefills in chunks without running out of memory:
benchmarks/long_prefill.py run as its own process (its peak RSS is then the engine's alone)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess, pytest.mark.model, pytest.mark.timeout(1800)]

# The wide model's weights (~1 GB in fp32), its 16k tokens of KV (256 MB) and a 2,048-token chunk's activations, with
# room for torch and the tokenizer: a prefill that held the whole prompt's scores (16k x 16k floats a head) would not.
PEAK_RSS_GIB = 6.0


def test_a_16k_prompt_prefills_within_bounded_memory(tmp_path):
    out = tmp_path / "long_prefill.json"
    subprocess.run([sys.executable, "-m", "benchmarks.long_prefill", "--kv-fraction", "0.1", "--out", str(out)],
                   check=True, timeout=1700)
    result = json.loads(out.read_text())["result"]
    assert result["prompt_tokens"] == 16384 and result["max_model_len"] == 32768
    assert result["peak_rss_gib"] < PEAK_RSS_GIB
