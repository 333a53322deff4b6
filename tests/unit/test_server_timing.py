"""The Server-Timing reader epd bench controlplane takes each response's worker engine time with."""

from __future__ import annotations

import math

import pytest

from controlplane.observability.server_timing import engine_seconds

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize("header, seconds", [
    ("engine;dur=3.250", 0.00325),
    ("app;dur=9, engine;desc=\"worker\";dur=12", 0.012),
    ("engine;dur=0", 0.0),
])
def test_the_engine_metric_is_read_in_seconds(header: str, seconds: float) -> None:
    assert engine_seconds(header) == pytest.approx(seconds)


@pytest.mark.parametrize("header", ["", "app;dur=3", "engine", "engine;dur=abc", "engines;dur=3"])
def test_a_missing_or_malformed_engine_metric_is_nan(header: str) -> None:
    assert math.isnan(engine_seconds(header))
