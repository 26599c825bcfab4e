"""The overhead benchmark's statistics: added latency is paired round by round, so drift cancels."""

from __future__ import annotations

import pytest

from benchmarks.gateway_overhead import summarize


def test_added_p50_and_rps_ratio_are_paired_with_each_rounds_direct_run():
    drift = [1.0, 1.0, 3.0]  # the machine got busy in the last round, for everyone alike
    rounds = {"direct": [{"p50": 0.002 * d, "p99": 0.004 * d, "rps": 1000 / d} for d in drift],
              "parrot": [{"p50": 0.002 * d + 0.001, "p99": 0.005 * d, "rps": 800 / d} for d in drift]}

    summary = summarize(rounds)

    assert summary["parrot"]["added_p50"] == pytest.approx(0.001)
    assert summary["parrot"]["rps_ratio"] == pytest.approx(0.8)
    assert summary["direct"]["added_p50"] == 0 and summary["direct"]["rps_ratio"] == 1
    assert summary["parrot"]["p50"] == pytest.approx(0.003)  # plain medians stay as they were
