"""The suite's registry of benchmarks, and running a selection of them into one :class:`SuiteRun`.

A benchmark is a function ``run(plan) -> list[Result]`` in its own module, registered below by name
and imported only when selected (so ``--only scheduler`` never imports torch's transfer paths or
transformers). Adding one is a new module plus one line here.
"""

from __future__ import annotations

import datetime as dt
import importlib
import os
import platform
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from bench import BENCH_EXTRA
from bench.micro.results import Result, SuiteRun
from bench.micro.timing import Plan


@dataclass(frozen=True)
class Benchmark:
    name: str
    target: str  # "module:function"
    summary: str


BENCHMARKS: tuple[Benchmark, ...] = (
    Benchmark("codec", "bench.micro.codec:run",
              "encode and decode per codec (bf16, fp8, int8, int4 keys/values, fp32) vs memcpy of the same bytes"),
    Benchmark("kv-grpc", "bench.micro.kv_transfer:run_grpc",
              "a whole-cache KV push over gRPC (bf16, int8) vs a raw gRPC stream and a raw TCP socket"),
    Benchmark("kv-tcp", "bench.micro.kv_transfer:run_tcp",
              "the same push over the bulk TCP connection, no gRPC call (int8 into a bf16 or an int8 cache, bf16) "
              "vs a raw TCP socket and a raw gRPC stream"),
    Benchmark("kv-shm", "bench.micro.kv_transfer:run_shm",
              "the same push through shared memory (same host) vs memcpy"),
    Benchmark("scheduler", "bench.micro.scheduler:run",
              "one routing decision over 64 decode + 64 prefill workers vs an empty call (prefix_affinity: "
              "with 100k indexed blocks per pool)"),
    Benchmark("engine", "bench.micro.engine:run",
              "a prefill step and decode steps at batch 1, 8, 32 vs HF transformers on the same checkpoint"),
    Benchmark("engine-loop", "bench.micro.engine_loop:run",
              "a one-token request's hand-off to the engine loop (loop thread, or stepped by the handler) "
              "vs a raw thread round trip"),
    Benchmark("redis", "bench.micro.redis_ops:run",
              "registry register / heartbeat / list (64 workers) vs a raw redis-py SET round trip"),
    Benchmark("tracing", "bench.micro.tracing:run",
              "a one-token request's spans under the default sampler, and their OTLP encoding, vs every span "
              "recorded"),
    Benchmark("sampler", "bench.micro.sampler:run",
              "one sampling step (temperature 0.8, top_p 0.95) of 1 and 32 rows over 32k tokens vs transformers' "
              "processors and multinomial"),
    Benchmark("detokenizer", "bench.micro.detokenizer:run",
              "streamed ids to text, per token, at 512 and 8,192 output tokens vs tokenizers' DecodeStream"),
)
NAMES: tuple[str, ...] = tuple(b.name for b in BENCHMARKS)
_BY_NAME = {b.name: b for b in BENCHMARKS}


class UnknownBenchmark(ValueError):
    """A name given to --only that is not a benchmark; the message lists the valid names."""


def select(names: list[str] | None) -> list[Benchmark]:
    """The benchmarks to run, in suite order; every one when ``names`` is empty or None."""
    if not names:
        return list(BENCHMARKS)
    unknown = [n for n in names if n not in _BY_NAME]
    if unknown:
        raise UnknownBenchmark(f"unknown benchmark{'s' if len(unknown) > 1 else ''} {', '.join(map(repr, unknown))}; "
                               f"valid names: {', '.join(NAMES)}")
    wanted = set(names)
    return [b for b in BENCHMARKS if b.name in wanted]


def _load(b: Benchmark) -> Callable[[Plan], list[Result]]:
    module, fn = b.target.split(":")
    return getattr(importlib.import_module(module), fn)


def _meta(plan: Plan) -> dict[str, object]:
    import torch

    return {"started_at": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "python": platform.python_version(), "platform": platform.platform(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "load_average_1m": os.getloadavg()[0], "torch": torch.__version__,
            "torch_threads": torch.get_num_threads(), "quick": plan.quick, "repeats": plan.repeats,
            "inner": plan.inner, "clock": plan.clock, "model": str(plan.model) if plan.model else "built-in demo model"}


def _failure(exc: Exception) -> str:
    """How a benchmark's failure is reported: a missing module of the bench extra by the package to install."""
    missing = exc.name.partition(".")[0] if isinstance(exc, ModuleNotFoundError) and exc.name else None
    if missing in BENCH_EXTRA:
        return f"needs {missing}, which is not installed (the bench extra: pip install {missing})"
    return f"{type(exc).__name__}: {exc}"


def run_suite(selected: list[Benchmark], plan: Plan, log: Callable[[str], None] = lambda m: None) -> SuiteRun:
    """Run each selected benchmark; a failing one is recorded in ``errors`` and the rest still run."""
    run = SuiteRun(meta=_meta(plan))
    start = time.perf_counter()
    for b in selected:
        log(f"{b.name}: {b.summary}")
        t0 = time.perf_counter()
        try:
            results = _load(b)(plan)
            if not results:
                raise RuntimeError("produced no results")
            run.results += results
        except Exception as exc:  # recorded and reported; the other benchmarks still run
            run.errors[b.name] = _failure(exc)
            log(f"{b.name} FAILED: {run.errors[b.name]}")
        run.seconds[b.name] = round(time.perf_counter() - t0, 3)
        log(f"{b.name}: {run.seconds[b.name]:.1f} s")
    run.meta["total_seconds"] = round(time.perf_counter() - start, 3)
    if any(b.name == "scheduler" for b in selected):
        run.notes.append("scheduler: scheduler.prefix_affinity is the decision with a 100,000-block prefix index "
                         "per pool (a large cluster's index); least_loaded and round_robin read no index")
    return run


def _fmt(x: float) -> str:
    """3 significant digits, without exponents for the large numbers a latency ratio reaches."""
    return f"{x:.3g}" if x < 1000 else f"{x:,.0f}"


def format_table(run: SuiteRun) -> str:
    """The readable table: median figure and reference, the ratio's median and [min-max] over the repeats."""
    rows = [("result", "figure", "reference", "ratio [min-max]", "better", "reference is")]
    for r in run.results:
        ratio = r.ratio
        rows.append((r.name, f"{_fmt(r.value.median)} {r.unit}", f"{_fmt(r.ref.median)} {r.unit}",
                     f"{_fmt(ratio.median)}x [{_fmt(ratio.min)}-{_fmt(ratio.max)}]", r.better, r.reference))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    m = run.meta
    lines.insert(0, f"epd bench micro: {len(run.results)} results, {m.get('repeats')} repeats each (ratio per "
                    f"repeat, figure / reference), {m.get('clock')} clock in-process, torch {m.get('torch')} with "
                    f"{m.get('torch_threads')} thread(s), {'quick sizes, ' if m.get('quick') else ''}"
                    f"{m.get('total_seconds', 0):.1f} s")
    for name, err in run.errors.items():
        lines.append(f"FAILED {name}: {err}")
    lines += [f"note: {n}" for n in run.notes]
    return "\n".join(lines)


def say(message: str) -> None:
    print(f"[micro] {message}", file=sys.stderr, flush=True)
