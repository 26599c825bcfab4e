"""Every Triton kernel compiles for an H100 (sm_90) cubin, checked on CPU with Triton's own ptxas."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Every test here starts processes (through its fixtures): marked here as well, so that
# `make test-fast` leaves the module unimported (tests/support/module_marks.py).
pytestmark = pytest.mark.subprocess

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.subprocess
def test_every_kernel_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}  # the compiler, not the interpreter
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    result = subprocess.run(
        [sys.executable, "-m", "kernels.compile_check", "90"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-4000:]
    lines = [line for line in result.stdout.splitlines() if line.startswith("sm_90")]
    kernels = {"decode", "prefill", "shared prefix", "merge splits", "kv_write"}
    assert all(any(name in line for line in lines) for name in kernels), result.stdout
    bf16_stack = [line for line in lines if "bf16" in line and "stack=  0 B" not in line]
    assert not bf16_stack, "bf16 kernels spill registers on sm_90:\n" + "\n".join(bf16_stack)
