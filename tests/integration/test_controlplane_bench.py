"""``epd bench controlplane`` end to end with tiny counts: correctness only, never speed."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.integration, pytest.mark.slow,
    # ray.serve's own pydantic models (ray/serve/config.py, imported by `from ray import serve`) pass
    # `update_type=` to pydantic.Field, which pydantic 2 deprecates; not ours to fix.
    pytest.mark.filterwarnings("ignore:Using extra keyword arguments on `Field` is deprecated"
                               ":pydantic.warnings.PydanticDeprecatedSince20"),
]


def _children() -> set[int]:
    """Live, non-zombie direct children of this process."""
    me = str(os.getpid())
    out = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        fields = text.rsplit(")", 1)[1].split()
        if fields[1] == me and fields[0] != "Z":
            out.add(int(stat.parent.name))
    return out


def test_a_run_reports_every_figure_exports_spans_and_cleans_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """One stack for everything (each start of one costs about 40 s here). The core figures; then
    --observability-cost: spans reach the OTLP receiver from the control plane and the prefill replica, and
    the figure is the median of each round's own on/off ratio. With --observability-tokens 3 the rounds'
    requests go through prefill, the KV transfer and decode, and each answers exactly 3 tokens. Then nothing
    the benchmark started is left running."""
    import ray

    from bench.controlplane_bench import BenchResult, format_table, measure

    # every request traced (the default samples one in ten: a handful of requests might export nothing);
    # parent-based, since this process's provider (made once) serves the later tracing tests too;
    # Ray, started inside, hands the variable to the replicas
    monkeypatch.setenv("OTEL_TRACES_SAMPLER", "parentbased_always_on")
    before = _children()
    res = measure(requests=10, throughput_requests=16, concurrency=4, observability_rounds=2, observability_tokens=3)

    assert isinstance(res, BenchResult)
    assert res.failures == []  # every response: HTTP 200 with exactly its token count
    # sequential, then three throughput rounds, then the observability rounds: 3 requests per connection, on and off
    assert res.ok_requests == 10 + 3 * 16 + 2 * 2 * 12
    for name in ("e2e_median_ms", "e2e_p90_ms", "compute_median_ms", "worker_engine_median_ms", "throughput_rps",
                 "serve_median_ms", "serve_p90_ms", "serve_rps"):
        value = getattr(res, name)
        assert isinstance(value, float) and value > 0, (name, value)
    table = format_table(res)
    assert "added latency median" in table and "3-token requests" in table
    # every response named its engine time, and the added latency is what is left of each request
    assert 0 < res.worker_engine_median_ms < res.e2e_p90_ms
    assert 0 < res.added_median_ms < res.e2e_p90_ms

    assert res.obs_tokens == 3
    assert len(res.obs_on_rps) == len(res.obs_off_rps) == len(res.obs_round_ratios) == 2
    assert res.obs_round_ratios == [on / off for on, off in zip(res.obs_on_rps, res.obs_off_rps)]
    assert min(res.obs_round_ratios) <= res.obs_ratio <= max(res.obs_round_ratios)
    # from the replica and from this process (named "epd-controlplane", unless an earlier test in this
    # process installed the global tracer provider under its own service name)
    assert res.spans_exported > 0 and {"epd-prefill", "epd-decode"} <= set(res.span_services)
    assert len(res.span_services) >= 3

    assert not ray.is_initialized()
    deadline = time.monotonic() + 15
    while (left := _children() - before) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not left, f"processes started by the benchmark still running: {sorted(left)}"
