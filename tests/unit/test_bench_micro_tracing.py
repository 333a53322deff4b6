"""``epd bench micro --only tracing`` in-process: both figures, each beside its SDK reference (speed is
the benchmark's business; this checks what it measures and reports)."""

from __future__ import annotations

import pytest

from bench.micro.timing import Plan
from bench.micro.tracing import BATCH, run

pytestmark = [pytest.mark.unit]


def test_the_tracing_benchmark_reports_spans_and_encoding_beside_the_sdk():
    results = {r.name: r for r in run(Plan(repeats=2, inner=1, quick=True, min_side_s=0.0))}
    assert set(results) == {"tracing.span", "tracing.encode"}
    for r in results.values():
        assert r.benchmark == "tracing" and r.unit == "us/span" and r.better == "lower"
        assert len(r.values) == len(r.ref_values) == 2
        assert "SDK" in r.reference or "exporter package" in r.reference
    assert f"a batch of {BATCH} spans" in results["tracing.encode"].note
