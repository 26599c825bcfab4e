"""The simulator's CPU calibration (benchmarks/sim/calibration.py, benchmarks/sim/__main__.py): the step costs solved
from the committed vLLM-CPU figures reproduce them, and a fronting run from a busier host is predicted with the
costs scaled by the one factor that fits its client-orchestrated mode."""

from __future__ import annotations

import json
import math

import pytest

from benchmarks.sim.__main__ import calibrate
from benchmarks.sim.calibration import engine_figures, fit


def test_the_fitted_step_costs_give_back_the_figures_they_were_fitted_on():
    cost, check = fit(engine_figures())
    assert min(cost.fixed_s, cost.prefill_token_s, cost.decode_seq_s, cost.attention_pair_s) > 0
    for workload in check.values():
        assert workload["fitted_s"] == pytest.approx(workload["measured_s"], rel=1e-6)


def test_a_busier_hosts_run_is_anchored_on_its_client_mode(tmp_path):
    args = {"rtt_ms": 250.0, "chain_chunks": 2, "chunk_words": 60, "chunks": 2, "coders": 2, "users": 2,
            "system_words": 100, "output_tokens": 8}
    run = {"date": "2026-12-02T11:00:00+00:00", "args": args,
           "results": {"chain": {"median_s": {"baseline": 6.0, "parrot": 5.0}}}}
    path = tmp_path / "fronted.json"
    path.write_text(json.dumps(run))
    fronted = calibrate([str(path)])["runs"][-1]
    anchored = {row["mode"]: row for row in fronted["anchored_rows"]}
    assert fronted["anchor_factor"] > 1  # the same app takes far longer than the idle host's costs say
    assert math.isclose(anchored["baseline"]["predicted_s"], 6.0, rel_tol=1e-3)
    assert anchored["parrot"]["predicted_s"] != anchored["baseline"]["predicted_s"]
