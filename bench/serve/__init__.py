"""``epd bench serve``: a load-test harness for any OpenAI-compatible endpoint.

Python API (what ``epd bench compare`` and other callers build on)::

    from bench.serve import (ServeBenchConfig, DatasetConfig, parse_slo, run_serve_bench,
                                          format_summary, write_report, write_plots)
    cfg = ServeBenchConfig(url="http://127.0.0.1:8000", dataset=DatasetConfig("random", num_prompts=64),
                           rates=(1.0, 2.0, 4.0), slo=parse_slo("ttft:500 tpot:50"), progress=False)
    result = run_serve_bench(cfg)            # BenchResult: one LoadPoint (metrics + outcomes) per rate
    print(format_summary(result))            # the table the CLI prints
    write_report(result, Path("out.json"), Path("plots/"))   # JSON + latency_cdf/slo_attainment/goodput PNGs
    write_plots({"disaggregated": a, "colocated": b}, Path("cmp/"))   # several series in one figure each
    result.points[0].metrics.goodput         # LoadPointMetrics: every figure of one load point

Bad input raises ``BenchInputError`` (the CLI prints it and exits 2). Modules, in the order a run uses them:
``config`` (flags, SLO parsing, URL), ``datasets`` (the prompts), ``arrivals`` (send times), ``client`` (one
timed streaming request), ``runner`` (probe, warm-up, the sweep), ``metrics`` (the figures, vLLM's
definitions), ``report`` (table, JSON, plots), ``cli`` (``add_serve_parser``).
"""

from __future__ import annotations

import importlib
from typing import Any

# Lazy: ``epd --help`` builds every parser (``cli.add_serve_parser``) and should not pay for httpx and numpy.
_EXPORTS = {
    "SLO": "config", "BenchInputError": "config", "DatasetConfig": "config", "ServeBenchConfig": "config",
    "parse_slo": "config", "Dist": "metrics", "LoadPointMetrics": "metrics", "RequestOutcome": "metrics",
    "compute_metrics": "metrics", "format_summary": "report", "write_json": "report", "write_plots": "report",
    "write_report": "report", "BenchResult": "runner", "LoadPoint": "runner", "arun_serve_bench": "runner",
    "run_serve_bench": "runner",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
