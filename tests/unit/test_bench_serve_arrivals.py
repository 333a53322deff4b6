"""Arrival processes: the mean rate, the burstiness statistics (CV^2 = 1/shape), seed determinism."""

from __future__ import annotations

import math

import numpy as np
import pytest

from bench.serve.arrivals import send_offsets

pytestmark = [pytest.mark.unit]
N = 40_000


@pytest.mark.parametrize("rate", [0.5, 4.0, 100.0])
@pytest.mark.parametrize("burstiness", [0.25, 1.0, 4.0])
def test_gaps_have_mean_one_over_rate_and_cv2_one_over_burstiness(rate: float, burstiness: float):
    offsets = send_offsets(N, rate, burstiness, seed=7)
    gaps = np.diff(offsets)
    assert offsets[0] == 0.0 and np.all(gaps >= 0)
    assert gaps.mean() == pytest.approx(1 / rate, rel=0.03)
    cv2 = gaps.var() / gaps.mean() ** 2
    assert cv2 == pytest.approx(1 / burstiness, rel=0.08)


def test_poisson_counts_per_window_have_variance_equal_to_mean():
    rate = 10.0
    offsets = np.array(send_offsets(N, rate, 1.0, seed=3))
    counts = np.bincount(offsets.astype(int))[:-1]  # arrivals per 1 s window (drop the partial last one)
    assert counts.mean() == pytest.approx(rate, rel=0.03)
    assert counts.var() / counts.mean() == pytest.approx(1.0, abs=0.1)


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("n", [24, 100])
def test_the_offered_rate_is_the_rate_asked_for(n: int, seed: int):
    """The gaps are rescaled as vLLM does: unscaled, seed 0's 100 requests at 2 req/s came at 1.68 req/s."""
    offsets = send_offsets(n, 2.0, 1.0, seed=seed)
    assert (n - 1) / offsets[-1] == pytest.approx(2.0)


def test_same_seed_same_offsets_other_seed_other_offsets():
    assert send_offsets(100, 2.0, 0.5, seed=1) == send_offsets(100, 2.0, 0.5, seed=1)
    assert send_offsets(100, 2.0, 0.5, seed=1) != send_offsets(100, 2.0, 0.5, seed=2)


def test_infinite_rate_sends_everything_at_once_and_bad_values_are_refused():
    assert send_offsets(5, math.inf) == [0.0] * 5
    assert send_offsets(0, 1.0) == []
    assert len(send_offsets(1, 1.0)) == 1
    for rate, b in ((0.0, 1.0), (-1.0, 1.0), (math.nan, 1.0), (1.0, 0.0)):
        with pytest.raises(ValueError):
            send_offsets(3, rate, b)
