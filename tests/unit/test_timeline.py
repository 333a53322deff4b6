"""The dashboard's history: counts add up over a window, quantiles come from the merged samples, old slots go."""

from __future__ import annotations

import pytest

from controlplane.observability.timeline import SAMPLES, SLOT_S, SLOTS, Timeline

pytestmark = [pytest.mark.unit]


class Clock:
    def __init__(self, t: float) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def test_rates_errors_and_depth_over_the_5_minute_and_1_hour_windows():
    clock = Clock(1_000_000.0)
    tl = Timeline(clock)
    for status in (200, 200, 200, 500, 429, 404):
        tl.answered(status)
    tl.depth(waiting=3, in_flight=5)
    tl.depth(waiting=1, in_flight=7)
    five = tl.view(300)
    assert len(five["t"]) == 30 and five["t"][-1] == pytest.approx(clock.t)
    assert sum(five["requests_per_s"]) * SLOT_S == pytest.approx(6)
    assert sum(five["errors_per_s"]) * SLOT_S == pytest.approx(2)  # 5xx and 429
    assert sum(five["client_errors_per_s"]) * SLOT_S == pytest.approx(1)
    assert [v for v in five["error_pct"] if v is not None] == [pytest.approx(100 * 2 / 6)]
    assert max(v for v in five["waiting"] if v is not None) == 3 and max(v for v in five["in_flight"] if v) == 7
    hour = tl.view(3600)
    assert len(hour["t"]) == 60 and sum(hour["requests_per_s"]) * 60 == pytest.approx(6)


def test_latency_quantiles_merge_slots_and_stages_are_kept_apart():
    clock = Clock(2_000_000.0)
    tl = Timeline(clock)
    for i in range(10):
        clock.t += 1
        tl.finished([("ttft", (i + 1) / 1000), ("stage:prefill", 0.002)], kv_logical_bytes=1000, kv_wire_bytes=500)
    lat = tl.view(300)["latency"]
    p50 = [v for v in lat["ttft_p50_ms"] if v is not None]
    assert p50 and all(1.0 <= v <= 10.0 for v in p50)
    assert [v for v in lat["stage:prefill_p50_ms"] if v is not None][0] == pytest.approx(2.0)
    six = tl.view(21600)
    merged = [v for v in six["latency"]["ttft_p50_ms"] if v is not None]
    assert merged == [pytest.approx(5.5)]  # one 6-minute bucket holds all ten: the median of 1..10 ms
    assert sum(six["kv_wire_mb_s"]) * 360 == pytest.approx(10 * 500 / 1e6)


def test_memory_is_bounded_in_time_and_samples():
    clock = Clock(3_000_000.0)
    tl = Timeline(clock)
    for _ in range(SAMPLES * 4):
        tl.finished([("e2e", 0.1)])
    tl.view(300)
    assert max(len(s.samples["e2e"]) for s in tl._slots.values()) == SAMPLES
    clock.t += SLOT_S * (SLOTS + 5)
    tl.answered(200)
    assert len(tl._slots) == 1  # six hours later, only the new slot is left
