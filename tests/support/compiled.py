"""The compiled engine, run in a process of its own (tests/engines/builtin/compiled_engine_run.py says why)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

COMPILED_MAX_TOKENS = 12  # tokens each prompt generates
ROOT = Path(__file__).resolve().parents[2]
RUNNER = ROOT / "tests" / "engines" / "builtin" / "compiled_engine_run.py"


def run_compiled_engine(model_dir, dtype: str, batches: list[list[list[int]]], **options) -> dict:
    """What an engine with ``compile`` generates for each batch of prompts (greedy, COMPILED_MAX_TOKENS each), and
    what it reports of its graphs."""
    request = {"model": str(model_dir), "dtype": dtype, "max_tokens": COMPILED_MAX_TOKENS, "batches": batches,
               **options}
    env = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
    done = subprocess.run([sys.executable, str(RUNNER)], input=json.dumps(request), capture_output=True, text=True,
                          cwd=ROOT, env=env, timeout=540)
    assert done.returncode == 0, done.stderr[-4000:]
    return json.loads(done.stdout.strip().splitlines()[-1])
