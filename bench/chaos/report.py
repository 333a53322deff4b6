"""The chaos run's figures: counts, agreement with ``generate()``, blocks left, replacement times,
latency percentiles before, during and after each fault; and the soak's drift."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any

from bench.chaos.faults import FaultResult
from bench.chaos.load import Outcome


def percentile(values: list[float], q: float) -> float | None:
    """Nearest-rank percentile (q in [0, 100]); None for no values."""
    if not values:
        return None
    s = sorted(values)
    return s[max(0, math.ceil(q / 100 * len(s)) - 1)]


@dataclass(frozen=True)
class Window:
    requests: int
    p50_s: float | None
    p99_s: float | None

    @classmethod
    def of(cls, outcomes: list[Outcome]) -> Window:
        lat = [o.latency for o in outcomes if o.ok]
        return cls(len(outcomes), percentile(lat, 50), percentile(lat, 99))


@dataclass(frozen=True)
class FaultFigures:
    fault: str
    target: str
    recovery_s: float
    replaced: bool
    detection_s: float  # the bound's allowance: how long the control plane may take to notice this fault
    before: Window
    during: Window
    after: Window
    p99_bound_s: float | None  # 2 x the fault-free p99 + detection
    within_bound: bool | None


@dataclass(frozen=True)
class ChaosReport:
    requests: int
    completed: int
    failed: int
    migrated: int
    matched: int
    blocks_leaked: int
    fault_free: Window
    faults: list[FaultFigures]
    errors: list[str] = field(default_factory=list)  # the first few failures' messages
    outcomes: list[tuple[float, float, int, str]] = field(default_factory=list)  # (start, end, status, error)
    blocks_held: dict[str, str] = field(default_factory=dict)  # worker id -> what it still held at the end

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def fault_figures(res: FaultResult, outcomes: list[Outcome], fault_free: Window, detection_s: float,
                  window_s: float) -> FaultFigures:
    before = [o for o in outcomes if res.at - window_s <= o.end < res.at]
    during = [o for o in outcomes if o.start < res.recovered_at and o.end > res.at]
    after = [o for o in outcomes if res.recovered_at <= o.start < res.recovered_at + window_s]
    d = Window.of(during)
    bound = None if fault_free.p99_s is None else 2 * fault_free.p99_s + detection_s
    within = None if bound is None or d.p99_s is None else d.p99_s <= bound
    return FaultFigures(res.spec.describe(), res.target, round(res.recovery_s, 2), res.replaced, detection_s,
                        Window.of(before), d, Window.of(after), bound, within)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{v * 1e3:.0f}"


def format_report(r: ChaosReport) -> str:
    pct = 100.0 * r.matched / r.completed if r.completed else 0.0
    lines = [f"requests {r.requests}: completed {r.completed}, failed {r.failed}, migrated {r.migrated}",
             f"equal to generate(): {r.matched}/{r.completed} ({pct:.1f}%)",
             f"KV blocks still held at the end: {r.blocks_leaked}"
             + "".join(f"\n  {worker}: {held}" for worker, held in r.blocks_held.items()),
             f"fault-free: {r.fault_free.requests} requests, p50 {_ms(r.fault_free.p50_s)} ms, "
             f"p99 {_ms(r.fault_free.p99_s)} ms", "",
             f"{'fault':<16}{'recovered':>10}{'replaced':>9}  {'p50/p99 ms before':>18}{'during':>12}{'after':>12}"
             f"{'bound':>8}  ok"]
    for f in r.faults:
        lines.append(f"{f.fault:<16}{f.recovery_s:>9.1f}s{'yes' if f.replaced else 'no':>9}  "
                     f"{_ms(f.before.p50_s) + '/' + _ms(f.before.p99_s):>18}"
                     f"{_ms(f.during.p50_s) + '/' + _ms(f.during.p99_s):>12}"
                     f"{_ms(f.after.p50_s) + '/' + _ms(f.after.p99_s):>12}{_ms(f.p99_bound_s):>8}  "
                     f"{'-' if f.within_bound is None else ('yes' if f.within_bound else 'NO')}")
    if any(f.within_bound is False for f in r.faults):
        lines.append("ok = NO: p99 during the fault passed its bound; a latency figure, so it leaves the exit "
                     "status as it is (failed or differing requests, and leaked blocks, make it 1)")
    first = min((o[0] for o in r.outcomes), default=0.0)
    for start, end, status, error in r.outcomes:
        if status != 200 or error:
            lines.append(f"failure at {start - first:.1f}-{end - first:.1f} s: {error or status}")
    return "\n".join(lines)


SOAK_RSS_LIMIT_PCT = 5.0  # the bound on a process's RSS growth after warm-up
WORKER_POOLS = ("encode", "prefill", "decode")


@dataclass(frozen=True)
class SoakSample:
    at_s: float
    rss: dict[str, int]  # process label -> bytes
    blocks_used: int
    running: dict[str, int] = field(default_factory=dict)  # decode worker label -> sequences, as last reported
    anon: dict[str, int] = field(default_factory=dict)  # process label -> resident anonymous bytes
    served: int = 0  # requests the soak's load had finished by then


@dataclass(frozen=True)
class SoakReport:
    minutes: float
    capacity_rps: float
    rate_rps: float
    requests: int
    failed: int
    matched: int
    rss_growth_pct: dict[str, float]  # per process, last sample over the first after warm-up
    blocks_baseline: int
    blocks_end: int
    samples: list[SoakSample]
    warmup_s: float = 0.0  # into the soak, where growth is measured from (seconds)
    journal_cap: int = 0  # the deployment's redis.journal_cap (requests whose journal Redis keeps)
    mix: bool = False  # the load was MixedWorkload's
    checked: int = 0  # answered requests of a kind with a reference (``matched`` of them were equal)
    anon_growth_pct: dict[str, float] = field(default_factory=dict)  # as rss_growth_pct, anonymous memory
    kinds: dict[str, tuple[int, int]] = field(default_factory=dict)  # request kind -> (sent, failed)
    idle: SoakSample | None = None  # memory ``idle_s`` after the load stopped
    idle_s: float = 0.0
    errors: list[str] = field(default_factory=list)  # the first few failures: "kind: message"
    retried: int = 0  # requests answered 429 ("full; retry later") at least once, then sent again
    retries: int = 0  # all those 429s
    retries_on_429: int = 0  # the most times one request was sent again
    preemptions: dict[str, int] = field(default_factory=dict)  # "pool worker_id" -> its engine's, at the end

    @property
    def ok(self) -> bool:
        """No request failed or differed from ``generate()``, and the KV blocks came back."""
        return self.failed == 0 and self.matched == self.checked and self.blocks_end <= self.blocks_baseline

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def kind_counts(outcomes: list[Outcome]) -> dict[str, tuple[int, int]]:
    counts: dict[str, tuple[int, int]] = {}
    for o in outcomes:
        sent, failed = counts.get(o.kind, (0, 0))
        counts[o.kind] = (sent + 1, failed + (not o.ok))
    return counts


def per_request_bytes(samples: list[SoakSample], name: str) -> float | None:
    """The least-squares slope of ``name``'s anonymous memory over requests served (bytes per request), over
    ``samples``; None with fewer than three samples or no spread in requests."""
    pts = [(s.served, s.anon[name]) for s in samples if name in s.anon]
    if len(pts) < 3:
        return None
    mx = sum(x for x, _ in pts) / len(pts)
    my = sum(y for _, y in pts) / len(pts)
    var = sum((x - mx) ** 2 for x, _ in pts)
    return None if var == 0 else sum((x - mx) * (y - my) for x, y in pts) / var


def _mib(v: int) -> str:
    return f"{v / 2**20:.1f}"


def format_soak(s: SoakReport) -> str:
    load = " mixed" if s.mix else ""
    lines = [f"soak {s.minutes:g} min at {s.rate_rps:.2f} req/s (70% of {s.capacity_rps:.2f} measured,{load} load): "
             f"{s.requests} requests, {s.failed} failed, {s.matched}/{s.checked} answered with a reference "
             f"equal to generate()"]
    if s.retried:
        lines.append(f"{s.retried} requests were answered 429 (full) and sent again after its Retry-After "
                     f"({s.retries} times in all); a request still refused after {s.retries_on_429} retries failed")
    if s.mix:
        lines.append("by kind (sent/failed): " + ", ".join(f"{k} {n}/{f}" for k, (n, f) in sorted(s.kinds.items())))
    lines += [f"first failures: {e}" for e in s.errors]
    if s.preemptions:  # a sequence preempted sends nothing until it recomputes: a latency cost, not a failure
        lines.append("engine preemptions (each worker's count at the end): " + ", ".join(
            f"{n} {c}" for n, c in sorted(s.preemptions.items())))
    lines += [f"KV blocks used: baseline {s.blocks_baseline}, peak "
              f"{max((x.blocks_used for x in s.samples), default=0)} (sampled), end {s.blocks_end}",
              f"growth after warm-up (from {s.warmup_s:g} s in to the load's end; request journal capped at "
              f"{s.journal_cap}): RSS, and anonymous memory (heap and tensors)"]
    first = next((x for x in s.samples if x.at_s >= s.warmup_s), None)
    last = s.samples[-1] if s.samples else None
    width = max((len(name) for name in s.rss_growth_pct), default=0) + 2
    for name, g in sorted(s.rss_growth_pct.items()):
        line = f"  {name:<{width}}RSS {g:+.1f}%"
        if first is not None and last is not None and name in first.rss and name in last.rss:
            line += f" ({_mib(first.rss[name])} -> {_mib(last.rss[name])} MiB)"
        if name in s.anon_growth_pct and first is not None and last is not None:
            line += (f", anon {s.anon_growth_pct[name]:+.1f}% ({_mib(first.anon[name])} -> "
                     f"{_mib(last.anon[name])} MiB)")
        lines.append(line)
    over = [f"{name} ({g:+.1f}%)" for name, g in sorted(s.rss_growth_pct.items()) if g >= SOAK_RSS_LIMIT_PCT]
    lines.append(f"processes at or over {SOAK_RSS_LIMIT_PCT:g}% RSS: {', '.join(over) or 'none'}")
    workers = sorted(n for n in s.rss_growth_pct if n.split(" ", 1)[0] in WORKER_POOLS)
    after_warmup = [x for x in s.samples if x.at_s >= s.warmup_s]
    slopes = {n: b for n in workers if (b := per_request_bytes(after_warmup, n)) is not None}
    if slopes:
        lines.append("workers' anonymous memory per request served after warm-up (least squares): " + ", ".join(
            f"{n} {b / 1024:+.1f} KiB" for n, b in slopes.items()))
    if s.idle is not None and last is not None:
        lines.append(f"workers' anonymous memory {s.idle_s:g} s after the load stopped (at its end -> idle): "
                     + ", ".join(f"{n} {_mib(last.anon[n])} -> {_mib(s.idle.anon[n])} MiB" for n in workers
                                 if n in last.anon and n in s.idle.anon))
    spread: dict[str, list[int]] = {}
    for x in s.samples:
        for name, n in x.running.items():
            spread.setdefault(name, []).append(n)
    if spread:
        lines.append("decode sequences running, mean (max) over the samples: " + ", ".join(
            f"{name} {sum(v) / len(v):.1f} ({max(v)})" for name, v in sorted(spread.items())))
    return "\n".join(lines)
