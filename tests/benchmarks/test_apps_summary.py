"""benchmarks/apps.py's figures: every baseline's ratio to every Parrot variant (before/after a policy in one run),
and the gateway config a fronting run gives each variant. Pure: no server runs."""

from __future__ import annotations

import tempfile
import types

from benchmarks.apps import summarize, upstream_config
from gateway.config import load_config


def test_baselines_are_compared_with_every_parrot_variant_and_the_variants_with_parrot():
    summary = summarize({"chain": {"parrot": [2.0, 4.0, 3.0], "parrot_submitted": [6.0, 6.0, 6.0],
                                   "baseline": [9.0, 9.0, 9.0], "baseline_router": [12.0, 12.0, 12.0]}})
    ratios = summary["chain"]["ratios"]
    assert ratios == {"parrot_submitted/parrot": 2.0, "baseline/parrot": 3.0, "baseline_router/parrot": 4.0,
                      "baseline/parrot_submitted": 1.5, "baseline_router/parrot_submitted": 2.0}


def test_each_prefill_variant_fronts_the_engine_as_its_name_says():
    vllm = types.SimpleNamespace(url="http://127.0.0.1:9/v1", model="/models/smol")
    seen = {}
    for variant in ("next_in_line", "submitted", "off"):
        with tempfile.NamedTemporaryFile("w", suffix=".toml") as file:
            file.write(upstream_config(vllm, "smol", variant))
            file.flush()
            config = load_config(file.name)
        upstream, = config.upstreams
        assert (upstream.model, upstream.base_url, upstream.upstream_model) == ("smol", vllm.url, "/models/smol")
        assert not config.builtin.enabled and config.semantic.stream_steps
        seen[variant] = (config.semantic.prefill_when, upstream.prefill_ahead)
    assert seen == {"next_in_line": ("next_in_line", True), "submitted": ("submitted", True),
                    "off": ("next_in_line", False)}

