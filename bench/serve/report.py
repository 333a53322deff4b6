"""The summary table, the JSON result file and the PNG plots of one or more benchmark results.

The plot functions take ``{label: BenchResult}`` so a comparison (e.g. disaggregated vs colocated) draws
both series in one figure; a single run passes one entry. Plots use matplotlib's Agg backend (no display).
The x axis of the rate plots is the offered rate; a point sent all at once (rate inf) is drawn at its
achieved request throughput instead.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bench.serve.metrics import Dist, LoadPointMetrics
from bench.serve.runner import BenchResult

_LAT = (("TTFT", "ttft_ms"), ("TPOT", "tpot_ms"), ("ITL", "itl_ms"), ("E2E", "e2e_ms"))


def _f(v: float | None, fmt: str = ".2f") -> str:
    return "-" if v is None else format(v, fmt)


def _load_label(m: LoadPointMetrics) -> str:
    rate = "all at once" if m.request_rate is None else f"{m.request_rate:g} req/s"
    shape = ("" if m.request_rate is None else " Poisson" if m.burstiness == 1
             else f" gamma(burstiness {m.burstiness:g})")
    cap = f", at most {m.max_concurrency} in flight" if m.max_concurrency else ""
    return f"{rate}{shape}{cap}"


def format_point(m: LoadPointMetrics) -> str:
    lines = [f"load: {_load_label(m)}",
             f"  requests      {m.num_requests} sent, {m.completed} completed, {m.failed} failed "
             f"in {m.duration_s:.2f} s",
             f"  throughput    {m.request_throughput:.2f} req/s, {m.output_throughput:.1f} output tok/s, "
             f"{m.total_token_throughput:.1f} total tok/s",
             f"  tokens        {m.total_input_tokens} input, {m.total_output_tokens} output",
             f"  {'latency (ms)':<12}  {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}"]
    for name, attr in _LAT:
        d: Dist = getattr(m, attr)
        lines.append(f"  {name:<12}  {_f(d.mean):>9} {_f(d.p50):>9} {_f(d.p90):>9} {_f(d.p99):>9}")
    if m.slo_ms:
        slo = ", ".join(f"{k} <= {v:g} ms" for k, v in m.slo_ms.items())
        att = ", ".join(f"{k} {v * 100:.1f}%" for k, v in m.slo_attainment.items())
        lines.append(f"  SLO           {slo}")
        lines.append(f"  attainment    {att}")
        lines.append(f"  goodput       {m.goodput:.2f} req/s ({m.good_requests} requests met every SLO)")
    for reason, count in m.failure_reasons.items():
        lines.append(f"  failed        {count} x {reason}")
    return "\n".join(lines)


def format_summary(result: BenchResult) -> str:
    """The human-readable report: the target, then each load point, then (for a sweep) one row per point."""
    ds = result.config.dataset
    head = [f"model {result.model} at {result.base_url} ({result.endpoint}), dataset {ds.name}, "
            f"{ds.num_prompts} requests per load point, seed {result.config.seed}, warm-up {result.config.warmup}"]
    blocks = head + [format_point(p.metrics) for p in result.points]
    if len(result.points) > 1:
        rows = [f"{'rate':>8} {'ok/sent':>9} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
                f"{'TPOT p50':>9} {'TPOT p99':>9} {'SLO met':>8} {'goodput':>8}"]
        for p in result.points:
            m = p.metrics
            rate = "inf" if m.request_rate is None else f"{m.request_rate:g}"
            met = f"{m.slo_attainment['all'] * 100:.1f}%" if m.slo_ms else "-"
            rows.append(f"{rate:>8} {f'{m.completed}/{m.num_requests}':>9} {m.request_throughput:>7.2f} "
                        f"{m.output_throughput:>8.1f} {_f(m.ttft_ms.p50):>9} {_f(m.ttft_ms.p99):>9} "
                        f"{_f(m.tpot_ms.p50):>9} {_f(m.tpot_ms.p99):>9} {met:>8} {m.goodput:>8.2f}")
        blocks.append("sweep (latencies in ms)\n" + "\n".join(rows))
    return "\n\n".join(blocks)


def write_json(result: BenchResult, path: Path, include_requests: bool = True) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result.to_json(include_requests), indent=2, allow_nan=False) + "\n")
    return path


def _pyplot() -> Any:  # matplotlib.pyplot, imported on first use
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def _x(m: LoadPointMetrics) -> float:
    return m.request_throughput if m.request_rate is None else m.request_rate


def plot_latency_cdfs(results: Mapping[str, BenchResult], path: Path) -> Path:
    """Empirical CDFs of TTFT, TPOT, ITL and E2E (ms), one line per (series, load point)."""
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(11, 8))
    for ax, (name, _) in zip(axes.flat, _LAT):
        for label, res in results.items():
            for p in res.points:
                ok = [o for o in p.outcomes if o.success]
                if name == "TTFT":
                    vals = [o.ttft_s for o in ok if o.ttft_s is not None]
                elif name == "TPOT":
                    vals = [t for o in ok if (t := o.tpot_s) is not None]
                elif name == "ITL":
                    vals = [g for o in ok for g in o.itl_s]
                else:
                    vals = [o.e2e_s for o in ok]
                if not vals:
                    continue
                xs = sorted(v * 1e3 for v in vals)
                ys = [(i + 1) / len(xs) for i in range(len(xs))]
                rate = "inf" if p.metrics.request_rate is None else f"{p.metrics.request_rate:g}/s"
                ax.step(xs, ys, where="post", label=f"{label} @ {rate}" if len(results) > 1 else f"rate {rate}")
        ax.set_xlabel(f"{name} (ms)")
        ax.set_ylabel("fraction of requests" if name != "ITL" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=7)
    fig.suptitle("latency CDFs")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _rate_plot(results: Mapping[str, BenchResult], path: Path, title: str, ylabel: str,
               series: list[tuple[str, Callable[[LoadPointMetrics], float], str]],
               ylim: tuple[float, float] | None = None) -> Path:
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, res in results.items():
        pts = sorted(res.points, key=lambda p: _x(p.metrics))
        for name, fn, style in series:
            ax.plot([_x(p.metrics) for p in pts], [fn(p.metrics) for p in pts], style, marker="o",
                    label=f"{label}: {name}" if len(results) > 1 else name)
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    if ylim is not None:
        ax.set_ylim(*ylim)
    else:
        ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _attainment_pct(slo: str) -> Callable[[LoadPointMetrics], float]:
    """The percent of a load point's requests meeting ``slo`` (NaN where the point has no such SLO)."""
    return lambda m: 100 * m.slo_attainment.get(slo, math.nan)


def plot_slo_attainment(results: Mapping[str, BenchResult], path: Path) -> Path:
    """Percent of requests meeting every SLO (and each one) against the request rate."""
    names = sorted({k for r in results.values() for p in r.points for k in p.metrics.slo_attainment})
    series: list[tuple[str, Callable[[LoadPointMetrics], float], str]] = [
        ("all SLOs" if k == "all" else f"{k} SLO", _attainment_pct(k), "-" if k == "all" else ":") for k in names]
    return _rate_plot(results, path, "SLO attainment vs request rate", "requests meeting the SLO (%)", series,
                      ylim=(0, 102))


def plot_goodput(results: Mapping[str, BenchResult], path: Path) -> Path:
    """Goodput (req/s meeting every SLO) and request throughput against the request rate."""
    series: list[tuple[str, Callable[[LoadPointMetrics], float], str]] = [
        ("goodput", lambda m: m.goodput, "-"), ("throughput", lambda m: m.request_throughput, "--")]
    return _rate_plot(results, path, "goodput vs request rate", "requests/s", series)


def write_plots(results: Mapping[str, BenchResult], plot_dir: Path) -> list[Path]:
    """``latency_cdf.png`` always; ``slo_attainment.png`` and ``goodput.png`` when SLOs were given."""
    written = [plot_latency_cdfs(results, plot_dir / "latency_cdf.png")]
    if any(not r.config.slo.is_empty() for r in results.values()):
        written.append(plot_slo_attainment(results, plot_dir / "slo_attainment.png"))
        written.append(plot_goodput(results, plot_dir / "goodput.png"))
    return written


def write_report(result: BenchResult, result_json: Path | None = None, plot_dir: Path | None = None) -> list[Path]:
    """Write the JSON result and/or the plots of one result; returns the paths written."""
    written = []
    if result_json is not None:
        written.append(write_json(result, result_json))
    if plot_dir is not None:
        written += write_plots({result.model: result}, plot_dir)
    return written
