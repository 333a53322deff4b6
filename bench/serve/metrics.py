"""Per-request timings -> the figures of one load point, defined as in vLLM's benchmark_serving.

For one request (times from ``perf_counter``, seconds):
  TTFT  send -> the first chunk that carries output text
  E2E   send -> the answer's last event (the last one with a choice; the usage event after it carries none)
  ITL   the gaps between consecutive output chunks (one per chunk, as vLLM; a chunk may hold >1 token)
  TPOT  (E2E - TTFT) / (output tokens - 1); undefined for a one-token answer (left out of the TPOT stats and
        counted as meeting a TPOT SLO, as vLLM does)
Over a load point: mean, std, p50, p90 and p99 of each (``numpy.percentile``, linear interpolation; ITL over
every gap of every successful request), request throughput = completed / duration, output token
throughput = output tokens / duration, total token throughput = (prompt + output tokens) / duration, where
duration runs from the first send to the last request's end. A request meets the SLO when every given bound
holds; SLO attainment = requests meeting it / requests sent (failures count as missing it), per metric and
for all together; goodput = requests meeting every bound / duration (requests/s).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from bench.serve.config import SLO

PERCENTILES = (50, 90, 99)


@dataclass
class RequestOutcome:
    """What the client saw of one request. Times in seconds; ``sent_at`` from the start of its load point."""

    success: bool
    sent_at: float = 0.0
    ttft_s: float | None = None
    e2e_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        if not self.success or self.ttft_s is None or self.output_tokens <= 1:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)

    def meets(self, slo: SLO) -> dict[str, bool]:
        """Per given SLO metric, whether this request met it (a failed request meets none)."""
        values = {"ttft": self.ttft_s, "tpot": self.tpot_s, "e2e": self.e2e_s}
        out = {}
        for name, bound in slo.as_dict().items():
            v = values[name]
            if not self.success:
                out[name] = False
            elif v is None and name == "tpot":  # a one-token answer: nothing to miss
                out[name] = True
            elif v is None:  # a success always has a TTFT and an E2E; a caller's outcome without one misses
                out[name] = False
            else:
                out[name] = v * 1e3 <= bound
        return out


@dataclass(frozen=True)
class Dist:
    """Summary of one latency in milliseconds; all None when there were no samples."""

    count: int
    mean: float | None
    std: float | None
    p50: float | None
    p90: float | None
    p99: float | None

    @classmethod
    def of_seconds(cls, samples: list[float]) -> Dist:
        if not samples:
            return cls(0, None, None, None, None, None)
        ms = np.asarray(samples, dtype=np.float64) * 1e3
        p50, p90, p99 = (float(v) for v in np.percentile(ms, PERCENTILES))
        return cls(len(samples), float(ms.mean()), float(ms.std()), p50, p90, p99)


@dataclass(frozen=True)
class LoadPointMetrics:
    """Every figure of one load point (one rate or one concurrency of a sweep)."""

    request_rate: float | None  # requests/s offered; None = all at once
    max_concurrency: int | None
    burstiness: float
    num_requests: int
    completed: int
    failed: int
    failure_reasons: dict[str, int]
    duration_s: float
    total_input_tokens: int
    total_output_tokens: int
    request_throughput: float
    output_throughput: float
    total_token_throughput: float
    ttft_ms: Dist
    tpot_ms: Dist
    itl_ms: Dist
    e2e_ms: Dist
    slo_ms: dict[str, float]
    slo_attainment: dict[str, float]  # "all" and each given metric -> fraction of requests sent
    good_requests: int
    goodput: float  # requests/s meeting every SLO (= request_throughput when no SLO is given)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def compute_metrics(outcomes: list[RequestOutcome], duration_s: float, slo: SLO, *,
                    request_rate: float | None = None, max_concurrency: int | None = None,
                    burstiness: float = 1.0) -> LoadPointMetrics:
    """The figures of one load point from its requests' outcomes and its wall-clock duration (seconds)."""
    ok = [o for o in outcomes if o.success]
    reasons = Counter(o.error or "unknown error" for o in outcomes if not o.success)
    dur = max(duration_s, 1e-9)
    tin = sum(o.prompt_tokens for o in ok)
    tout = sum(o.output_tokens for o in ok)
    met = [o.meets(slo) for o in outcomes]
    names = list(slo.as_dict())
    good = sum(1 for m in met if all(m.values())) if names else len(ok)
    n = max(len(outcomes), 1)
    attainment = {"all": good / n} | {k: sum(m[k] for m in met) / n for k in names}
    return LoadPointMetrics(
        request_rate=request_rate, max_concurrency=max_concurrency, burstiness=burstiness,
        num_requests=len(outcomes), completed=len(ok), failed=len(outcomes) - len(ok),
        failure_reasons=dict(reasons.most_common()), duration_s=duration_s,
        total_input_tokens=tin, total_output_tokens=tout, request_throughput=len(ok) / dur,
        output_throughput=tout / dur, total_token_throughput=(tin + tout) / dur,
        ttft_ms=Dist.of_seconds([o.ttft_s for o in ok if o.ttft_s is not None]),
        tpot_ms=Dist.of_seconds([t for o in ok if (t := o.tpot_s) is not None]),
        itl_ms=Dist.of_seconds([g for o in ok for g in o.itl_s]),
        e2e_ms=Dist.of_seconds([o.e2e_s for o in ok]),
        slo_ms=slo.as_dict(), slo_attainment=attainment, good_requests=good, goodput=good / dur)
