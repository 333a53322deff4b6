"""vLLM's flat result keys (``benchmark_serving``'s JSON), computed from one load point's requests.

``mean_ttft_ms``, ``median_ttft_ms``, ``std_ttft_ms`` and ``p{P}_ttft_ms`` for each metric of
``--percentile-metrics`` (ttft, tpot, itl, e2el) and each P of ``--metric-percentiles``, plus ``duration``
(seconds), ``completed``, token totals and throughputs, ``request_goodput``, the run's identity (``date``,
``backend``, ``model_id``, ``num_prompts``, ``request_rate``, ``burstiness``, ``max_concurrency``) and the
per-request lists (``input_lens``, ``output_lens``, ``ttfts``, ``itls`` in seconds, ``errors``). A metric
with no sample (e.g. TPOT when every answer is one token) is null rather than vLLM's 0.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Any

import numpy as np

from bench.serve.config import ServeBenchConfig
from bench.serve.metrics import LoadPointMetrics, RequestOutcome

PERCENTILE_METRICS = ("ttft", "tpot", "itl", "e2el")


def percentile_word(p: float) -> str:
    """vLLM's spelling of a percentile in a key: 99 -> "99", 99.9 -> "99.9"."""
    return str(int(p)) if float(p).is_integer() else str(p)


def _samples_ms(outcomes: list[RequestOutcome], metric: str) -> list[float]:
    ok = [o for o in outcomes if o.success]
    if metric == "ttft":
        values = [o.ttft_s for o in ok if o.ttft_s is not None]
    elif metric == "tpot":
        values = [t for o in ok if (t := o.tpot_s) is not None]
    elif metric == "itl":
        values = [g for o in ok for g in o.itl_s]
    else:
        values = [o.e2e_s for o in ok]
    return [v * 1e3 for v in values]


def flat_keys(metrics: LoadPointMetrics, outcomes: list[RequestOutcome], config: ServeBenchConfig, model: str,
              endpoint: str, started: datetime) -> dict[str, Any]:
    rate = metrics.request_rate
    out: dict[str, Any] = {
        "date": started.strftime("%Y%m%d-%H%M%S"), "backend": "openai-chat" if endpoint == "chat" else "openai",
        "model_id": model, "tokenizer_id": str(config.dataset.tokenizer) if config.dataset.tokenizer else model,
        "num_prompts": metrics.num_requests, "request_rate": "inf" if rate is None or math.isinf(rate) else rate,
        "burstiness": metrics.burstiness, "max_concurrency": metrics.max_concurrency,
        "duration": metrics.duration_s, "completed": metrics.completed,
        "total_input_tokens": metrics.total_input_tokens, "total_output_tokens": metrics.total_output_tokens,
        "request_throughput": metrics.request_throughput,
        "request_goodput": metrics.goodput if metrics.slo_ms else None,
        "output_throughput": metrics.output_throughput, "total_token_throughput": metrics.total_token_throughput,
        "input_lens": [o.prompt_tokens for o in outcomes], "output_lens": [o.output_tokens for o in outcomes],
        "ttfts": [o.ttft_s if o.ttft_s is not None else 0.0 for o in outcomes],
        "itls": [list(o.itl_s) for o in outcomes], "errors": [o.error or "" for o in outcomes],
    }
    for metric in config.percentile_metrics:
        ms = _samples_ms(outcomes, metric)
        arr = np.asarray(ms, dtype=np.float64)
        out[f"mean_{metric}_ms"] = float(arr.mean()) if ms else None
        out[f"median_{metric}_ms"] = float(np.median(arr)) if ms else None
        out[f"std_{metric}_ms"] = float(arr.std()) if ms else None
        for p in config.metric_percentiles:
            out[f"p{percentile_word(p)}_{metric}_ms"] = float(np.percentile(arr, p)) if ms else None
    return out
