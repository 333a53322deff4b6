"""``--compare BASELINE.json``: which ratios moved beyond their run-to-run spread, and which way.

Pure logic over two :class:`SuiteRun` objects. A result's ratio (figure / in-run reference) has
*moved* when both hold:
  1. the two runs' [min, max] ranges of the ratio do not overlap (the union of both spreads), and
  2. the medians differ by more than ``tolerance`` (a fraction of the baseline's median), so a run
     whose repeats happened to agree closely does not flag a change too small to matter.
Which way is worse comes from the result's ``better`` ("higher" for throughput, "lower" for latency).
A baseline result absent from this run is reported as missing, with why (not selected by --only, its
benchmark failed, or no longer produced); it is not a regression. Only regressions fail the comparison.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from bench.micro.results import Result, Spread, SuiteRun

DEFAULT_TOLERANCE = 0.10


class Status(enum.StrEnum):
    OK = "ok"  # within the spread / tolerance
    REGRESSED = "REGRESSED"
    IMPROVED = "improved"
    MISSING = "missing"  # in the baseline, not in this run
    NEW = "new"  # in this run, not in the baseline
    INCOMPARABLE = "incomparable"  # unit or direction changed between the runs


@dataclass(frozen=True)
class Verdict:
    name: str
    status: Status
    baseline: Spread | None = None
    current: Spread | None = None
    detail: str = ""

    @property
    def change(self) -> float | None:
        """This run's median ratio over the baseline's (1.0 = unchanged), when both exist."""
        if self.baseline is None or self.current is None:
            return None
        return self.current.median / self.baseline.median


def judge(base: Result, cur: Result, tolerance: float = DEFAULT_TOLERANCE) -> Verdict:
    """The verdict on one result present in both runs."""
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if (base.unit, base.better) != (cur.unit, cur.better):
        return Verdict(cur.name, Status.INCOMPARABLE, base.ratio, cur.ratio,
                       f"baseline is {base.unit} ({base.better} is better), this run {cur.unit} ({cur.better} is "
                       f"better)")
    b, c = base.ratio, cur.ratio
    up = c.min > b.max and c.median > b.median * (1 + tolerance)
    down = c.max < b.min and c.median < b.median * (1 - tolerance)
    if not (up or down):
        return Verdict(cur.name, Status.OK, b, c)
    worse = down if cur.better == "higher" else up
    pct = (c.median / b.median - 1) * 100
    detail = (f"ratio median {b.median:.4g} -> {c.median:.4g} ({pct:+.1f}%), outside both runs' spreads "
              f"[{b.min:.4g}, {b.max:.4g}] and [{c.min:.4g}, {c.max:.4g}] and the {tolerance:.0%} tolerance; "
              f"{cur.better} is better")
    return Verdict(cur.name, Status.REGRESSED if worse else Status.IMPROVED, b, c, detail)


def compare(baseline: SuiteRun, current: SuiteRun, tolerance: float = DEFAULT_TOLERANCE) -> list[Verdict]:
    """A verdict for every result in either run: baseline order first, then results new in this run."""
    now = {r.name: r for r in current.results}
    before = {r.name: r for r in baseline.results}
    out = []
    for name, base in before.items():
        cur = now.get(name)
        if cur is not None:
            out.append(judge(base, cur, tolerance))
        elif base.benchmark in current.errors:
            out.append(Verdict(name, Status.MISSING, base.ratio, None,
                               f"benchmark {base.benchmark!r} failed in this run: {current.errors[base.benchmark]}"))
        elif base.benchmark not in current.benchmarks:
            out.append(Verdict(name, Status.MISSING, base.ratio, None,
                               f"benchmark {base.benchmark!r} was not run (--only)"))
        else:
            out.append(Verdict(name, Status.MISSING, base.ratio, None,
                               f"benchmark {base.benchmark!r} ran but no longer produces this result"))
    for name, cur in now.items():
        if name not in before:
            out.append(Verdict(name, Status.NEW, None, cur.ratio, "not in the baseline"))
    return out


_SETUP = {"quick": "--quick sizes", "clock": "clock", "torch_threads": "torch threads", "model": "model"}


def setup_differences(baseline: SuiteRun, current: SuiteRun) -> list[str]:
    """How the two runs were set up differently (sizes, clock, threads, model): their ratios are then not
    like for like, which the reader should know before trusting a verdict."""
    out = []
    for key, what in _SETUP.items():
        b, c = baseline.meta.get(key), current.meta.get(key)
        if b != c:
            out.append(f"{what} differ: baseline {b!r}, this run {c!r}")
    return out


def regressions(verdicts: list[Verdict]) -> list[Verdict]:
    return [v for v in verdicts if v.status is Status.REGRESSED]


def format_verdicts(verdicts: list[Verdict], baseline_name: str) -> str:
    """A table of every verdict, then one line per regression / improvement / missing result with the detail."""
    def rng(s: Spread | None) -> str:
        return "-" if s is None else f"{s.median:.4g} [{s.min:.4g}-{s.max:.4g}]"

    rows = [("result", "baseline ratio [min-max]", "this run [min-max]", "change", "status")]
    for v in verdicts:
        change = "-" if v.change is None else f"{(v.change - 1) * 100:+.1f}%"
        rows.append((v.name, rng(v.baseline), rng(v.current), change, str(v.status)))
    widths = [max(len(r[i]) for r in rows) for i in range(5)]
    lines = [f"compared with {baseline_name}:"]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
    for v in verdicts:
        if v.status is not Status.OK and v.detail:
            lines.append(f"  {v.status}: {v.name}: {v.detail}")
    counts = {s: sum(v.status is s for v in verdicts) for s in Status}
    lines.append(", ".join(f"{n} {s.value.lower()}" for s, n in counts.items() if n))
    return "\n".join(lines)
