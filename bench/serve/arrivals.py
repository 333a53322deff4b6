"""When each request is sent: Poisson or gamma arrivals at a rate, as vLLM's benchmark_serving draws them.

Inter-arrival gaps are gamma(shape=burstiness, scale=1/(rate*burstiness)): the mean gap is 1/rate whatever
the burstiness, and the squared coefficient of variation of the gaps is 1/burstiness. burstiness 1 is the
exponential, i.e. a Poisson process; below 1 requests come in bursts, above 1 more evenly. The gaps are
then scaled so the last request goes at (n - 1) / rate, as vLLM rescales them: a draw of a hundred gaps
sums 10-20% off its mean often enough that a point labelled R req/s would offer 0.84 R. A rate of ``inf``
sends every request at time 0 (the load is then bounded only by ``--concurrency``).
"""

from __future__ import annotations

import math

import numpy as np


def send_offsets(n: int, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start of the run at which each of ``n`` requests is sent; the first goes at 0.

    Deterministic in ``seed``. Offsets are absolute (the sender sleeps until each), so scheduling jitter
    does not accumulate into a lower rate.
    """
    if n <= 0:
        return []
    if rate <= 0 or math.isnan(rate) or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be positive (got {rate}, {burstiness})")
    if math.isinf(rate):
        return [0.0] * n
    rng = np.random.default_rng(seed)
    gaps = rng.gamma(shape=burstiness, scale=1.0 / (rate * burstiness), size=n - 1)
    offsets = np.cumsum(gaps)
    if n > 1 and offsets[-1] > 0:
        offsets *= (n - 1) / rate / offsets[-1]
    return [0.0] + offsets.tolist()
