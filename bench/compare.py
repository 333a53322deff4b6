"""``epd bench compare``: one workload against the disaggregated and the colocated deployment, in one run.

Both deployments are built from the same settings (model, engine, block size) by
``controlplane.serve.build`` and served on loopback; the load is ``epd bench serve``'s (its Python
API), with the same prompts, arrivals and seed for both. Equal hardware: each worker that computes
gets one core of ``--cores`` (torch threads = 1 and CPU affinity), so

  disaggregated   one prefill worker on cores[0], one decode worker on cores[1]
                  (the encode worker, idle on a text workload, shares cores[0])
  colocated       one worker per core, each prefilling and decoding in one engine

and the ingress, scheduler and Redis run unpinned in both. The figure is the goodput ratio
(disaggregated / colocated) at each rate under the given SLOs, printed as a table, written as JSON and
drawn as plots (the serve harness's CDF/attainment/goodput plots with both series, and the ratio).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.cli_args import check_writable, path_arg

if TYPE_CHECKING:  # annotations only: the module imports the control plane lazily, where it is used
    from controlplane.settings import Settings

MODES = ("disaggregated", "colocated")
MiB = 2**20


@dataclass(frozen=True)
class CompareConfig:
    model: Path | None = None
    input_len: int = 1024
    output_len: int = 32
    num_prompts: int = 32
    rates: tuple[float, ...] = (2.0, 4.0, 8.0)
    slo: str = "ttft:2000 tpot:40"
    seed: int = 0
    warmup: int = 2
    cores: tuple[int, ...] = (0, 1)
    kv_cache_bytes: int = 256 * MiB
    out_dir: Path | None = None
    progress: bool = True


@dataclass
class CompareResult:
    config: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)  # mode -> BenchResult
    seconds: dict[str, float] = field(default_factory=dict)

    def ratios(self) -> list[tuple[float | None, float, float, float | None]]:
        """Per load point: (rate, disaggregated goodput, colocated goodput, ratio or None when 0/0)."""
        out = []
        for d, c in zip(self.results["disaggregated"].points, self.results["colocated"].points):
            gd, gc = d.metrics.goodput, c.metrics.goodput
            out.append((d.metrics.request_rate, gd, gc, gd / gc if gc > 0 else (None if gd == 0 else math.inf)))
        return out


def deployment_settings(mode: str, port: int, cfg: CompareConfig) -> Settings:
    """The settings of one side: identical engines, one core per computing worker."""
    import secrets

    from controlplane.settings import Settings

    engine = {"threads": 1, "kv_cache_bytes": cfg.kv_cache_bytes}
    cores = list(cfg.cores)
    common: dict[str, Any] = {
        "mode": mode,
        # a fixed admin token: build() then writes no token file under the user's home
        "api": {"host": "127.0.0.1", "port": port, "admin_token": secrets.token_urlsafe(32)},
        "scheduler": {"queue_size": 4096, "queue_timeout_s": 600.0},
    }
    if cfg.model is not None:
        common["model"] = str(cfg.model)
    if mode == "disaggregated":
        pools = {"encode": {"replicas": 1, "num_cpus": 0.25, "cpu_affinity": cores[:1], "engine": engine},
                 "prefill": {"replicas": 1, "num_cpus": 0.25, "cpu_affinity": cores[:1], "engine": engine},
                 "decode": {"replicas": 1, "num_cpus": 0.25, "cpu_affinity": cores[1:2], "engine": engine}}
    else:
        pools = {"decode": {"replicas": len(cores), "num_cpus": 0.25, "cpu_affinity": cores, "engine": engine}}
    return Settings.load(None, {**common, **pools})


def run_side(mode: str, cfg: CompareConfig, say: Any) -> Any:
    """Bring one deployment up, run the workload against it, take it down. Returns its BenchResult."""
    from bench.controlplane_bench import _free_port, _Server, _wait_ready
    from bench.serve import DatasetConfig, ServeBenchConfig, parse_slo, run_serve_bench
    from controlplane.serve import build
    from workers.runtime.default_model import ensure_default_checkpoint

    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    tokenizer = cfg.model or ensure_default_checkpoint()  # exact prompt lengths in the model's own tokens
    say(f"{mode}: starting the deployment")
    dep = build(deployment_settings(mode, port, cfg))
    try:
        with _Server(dep.app, port):
            _wait_ready(url)
            say(f"{mode}: {cfg.num_prompts} requests at each of {', '.join(f'{r:g}' for r in cfg.rates)} req/s")
            bench = ServeBenchConfig(
                url=url, dataset=DatasetConfig("random", num_prompts=cfg.num_prompts, input_len=cfg.input_len,
                                               output_len=cfg.output_len, tokenizer=tokenizer),
                rates=cfg.rates, warmup=cfg.warmup, seed=cfg.seed, ignore_eos=True, slo=parse_slo(cfg.slo),
                progress=cfg.progress)
            return run_serve_bench(bench)
    finally:
        dep.close()


def compare(cfg: CompareConfig, log: Any = None) -> CompareResult:
    from bench.serve import parse_slo

    parse_slo(cfg.slo)  # a bad spec fails before anything starts
    say = log or (lambda msg: None)
    res = CompareResult({k: (str(v) if isinstance(v, Path) else v) for k, v in cfg.__dict__.items()})
    for mode in MODES:
        t0 = time.monotonic()
        res.results[mode] = run_side(mode, cfg, say)
        res.seconds[mode] = time.monotonic() - t0
    return res


def _fmt(x: float | None, spec: str = ".2f") -> str:
    if x is None:
        return "-"
    return "inf" if math.isinf(x) else format(x, spec)


def format_table(res: CompareResult) -> str:
    rows = [("rate req/s", "mode", "req/s", "goodput", "SLO met", "TTFT p50", "TTFT p99", "TPOT p50", "TPOT p99",
             "failed")]
    for mode in MODES:
        for p in res.results[mode].points:
            m = p.metrics
            rows.append((_fmt(m.request_rate, "g"), mode, _fmt(m.request_throughput), _fmt(m.goodput),
                         f"{m.slo_attainment.get('all', 1.0):.0%}", _fmt(m.ttft_ms.p50, ".0f"),
                         _fmt(m.ttft_ms.p99, ".0f"), _fmt(m.tpot_ms.p50, ".1f"), _fmt(m.tpot_ms.p99, ".1f"),
                         str(m.failed)))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    lines.append(f"goodput ratio, disaggregated / colocated, at SLO {res.config['slo']} (target >= 1.5x):")
    for rate, gd, gc, ratio in res.ratios():
        lines.append(f"  {_fmt(rate, 'g'):>6} req/s: {_fmt(gd)} / {_fmt(gc)} = {_fmt(ratio)}x")
    best = max((r for *_, r in res.ratios() if r is not None), default=None)
    lines.append(f"  best: {_fmt(best)}x")
    return "\n".join(lines)


def write_outputs(res: CompareResult, out_dir: Path) -> list[Path]:
    from bench.serve import write_plots
    from bench.serve.report import _pyplot

    out_dir.mkdir(parents=True, exist_ok=True)
    data = {"config": res.config, "seconds": res.seconds,
            "ratios": [{"rate": r, "disaggregated_goodput": gd, "colocated_goodput": gc,
                        "ratio": None if x is None or math.isinf(x) else x} for r, gd, gc, x in res.ratios()],
            "modes": {m: [p.metrics.to_json() for p in res.results[m].points] for m in MODES}}
    path = out_dir / "compare.json"
    path.write_text(json.dumps(data, indent=2) + "\n")
    written = [path, *write_plots(dict(res.results), out_dir)]
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(6, 4))
    pts = [(r, x) for r, _, _, x in res.ratios() if r is not None and x is not None and math.isfinite(x)]
    ax.plot([r for r, _ in pts], [x for _, x in pts], marker="o", label="disaggregated / colocated")
    ax.axhline(1.5, linestyle="--", color="grey", label="target 1.5x")
    ax.axhline(1.0, linestyle=":", color="black")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("goodput ratio")
    ax.set_title(f"goodput ratio at SLO {res.config['slo']}")
    ax.legend()
    fig.tight_layout()
    ratio_png = out_dir / "goodput_ratio.png"
    fig.savefig(ratio_png, dpi=100)
    plt.close(fig)
    return [*written, ratio_png]


def add_compare_parser(bench: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = bench.add_parser("compare", help="one workload against disaggregated and colocated serving: goodput ratio",
                         description=(
                             "Run one workload against the disaggregated and the colocated deployment of the same "
                             "model and engine settings, both on loopback with equal cores (--cores: one per "
                             "computing worker), and report the goodput ratio (disaggregated / colocated) at each "
                             "request rate under the --goodput SLOs: a table on stdout, JSON and plots in --out."))
    p.add_argument("--model", type=path_arg, default=None, help="HF checkpoint folder (default: the demo model)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens (default 1024: prefill-heavy)")
    p.add_argument("--output-len", type=int, default=32, help="tokens generated per request (default 32)")
    p.add_argument("--num-prompts", type=int, default=32, help="requests per rate and mode (default 32)")
    p.add_argument("--rate", default="2,4,8", help="comma list of request rates to sweep (default 2,4,8)")
    p.add_argument("--goodput", nargs="+", default=["ttft:2000", "tpot:40"], metavar="METRIC:MS",
                   help="SLOs, e.g. ttft:2000 tpot:40 (default)")
    p.add_argument("--cores", default="0,1", help="one core per computing worker (default 0,1)")
    p.add_argument("--seed", type=int, default=0,
                   help="seed of the prompts and arrival times, the same for both modes (default: %(default)s)")
    p.add_argument("--out", type=path_arg, default=Path("bench-compare"),
                   help="folder for the JSON results and plots (default: %(default)s)")
    p.add_argument("--no-progress", action="store_true", help="do not print progress lines")
    p.set_defaults(func=cmd_bench_compare)


def cmd_bench_compare(args: argparse.Namespace) -> int:
    import os

    from bench.serve.config import BenchInputError, parse_float_list

    try:
        cores = tuple(int(c) for c in args.cores.split(","))
    except ValueError:
        print(f"epd bench compare: error: --cores takes a comma list of core numbers, got {args.cores!r}",
              file=sys.stderr)
        return 2
    have = os.sched_getaffinity(0)
    if len(cores) < 2 or any(c not in have for c in cores):
        print(f"epd bench compare: error: --cores needs two or more of this machine's cores {sorted(have)}, "
              f"got {list(cores)}", file=sys.stderr)
        return 2
    try:
        rates = tuple(parse_float_list(args.rate, "--rate"))
        cfg = CompareConfig(model=args.model, input_len=args.input_len, output_len=args.output_len,
                            num_prompts=args.num_prompts, rates=rates, slo=" ".join(args.goodput), seed=args.seed,
                            cores=cores, out_dir=args.out, progress=not args.no_progress)
        if min(cfg.input_len, cfg.output_len, cfg.num_prompts) < 1:
            raise BenchInputError("--input-len, --output-len and --num-prompts must be >= 1")
        check_writable("--out", args.out, folder=True)  # before both deployments run, not after
        res = compare(cfg, log=lambda m: print(f"[compare] {m}", file=sys.stderr, flush=True))
    except BenchInputError as exc:
        print(f"epd bench compare: error: {exc}", file=sys.stderr)
        return 2
    print(f"{cfg.num_prompts} requests per rate, {cfg.input_len} prompt + {cfg.output_len} output tokens, "
          f"cores {list(cores)}, one per computing worker")
    print(format_table(res))
    for path in write_outputs(res, args.out):
        print(f"wrote {path}")
    return 0
