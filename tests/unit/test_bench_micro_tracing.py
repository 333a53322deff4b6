"""``epd bench micro --only tracing`` in-process: both figures, each beside its reference (speed is the
benchmark's business; this checks what it measures and reports)."""

from __future__ import annotations

import pytest

from bench.micro.timing import Plan
from bench.micro.tracing import BATCH, run

pytestmark = [pytest.mark.unit]


def test_the_tracing_benchmark_prices_the_default_sampler_and_the_export_encoding():
    results = {r.name: r for r in run(Plan(repeats=2, inner=1, quick=True, min_side_s=0.0))}
    assert set(results) == {"tracing.span", "tracing.encode"}
    for r in results.values():
        assert r.benchmark == "tracing" and r.unit == "us/span" and r.better == "lower"
        assert len(r.values) == len(r.ref_values) == 2
        assert "ALWAYS_ON" in r.reference
    assert "parentbased_traceidratio 0.1" in results["tracing.span"].note
    assert f"a batch of {BATCH} spans" in results["tracing.encode"].note
