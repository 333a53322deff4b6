"""``epd bench micro --compare`` logic on synthetic results with known answers (no benchmark runs here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bench.micro.compare import Status, compare, format_verdicts, judge, regressions
from bench.micro.results import SCHEMA, Result, ResultsFileError, Spread, SuiteRun
from bench.micro.runner import NAMES, UnknownBenchmark, select
from bench.micro.timing import Plan, best, paired

pytestmark = [pytest.mark.unit]


def res(name: str, ratios: list[float], better: str = "higher", unit: str = "GB/s", benchmark: str | None = None
        ) -> Result:
    """A result whose reference is 1.0 in every repeat, so its ratios are exactly ``ratios``."""
    return Result(name, benchmark or name.split(".")[0], unit, better, "ref",  # type: ignore[arg-type]  # parametrized as str
                  tuple(ratios), tuple(1.0 for _ in ratios))


def run_of(*results: Result, benchmarks: list[str] | None = None, errors: dict[str, str] | None = None) -> SuiteRun:
    names = benchmarks if benchmarks is not None else sorted({r.benchmark for r in results})
    return SuiteRun(meta={"quick": False}, results=list(results), errors=errors or {},
                    seconds={n: 1.0 for n in names})


# ------------------------------------------------------------------ one result
def test_ratio_is_taken_per_repeat_and_spread_is_min_median_max() -> None:
    r = Result("codec.int8.encode", "codec", "GB/s", "higher", "memcpy", (2.0, 3.0, 8.0), (4.0, 3.0, 4.0))
    assert r.ratios == (0.5, 1.0, 2.0)
    assert r.ratio == Spread(0.5, 1.0, 2.0)
    assert r.value == Spread(2.0, 3.0, 8.0)


def test_higher_is_better_drop_beyond_both_spreads_is_a_regression() -> None:
    v = judge(res("codec.int8.encode", [1.00, 1.02, 1.04]), res("codec.int8.encode", [0.70, 0.72, 0.75]))
    assert v.status is Status.REGRESSED
    assert v.change == pytest.approx(0.72 / 1.02)
    assert "codec.int8.encode" == v.name and "-29.4%" in v.detail


def test_higher_is_better_rise_beyond_both_spreads_is_an_improvement() -> None:
    v = judge(res("kv-grpc.bf16", [1.0, 1.0, 1.1]), res("kv-grpc.bf16", [1.5, 1.6, 1.7]))
    assert v.status is Status.IMPROVED


def test_lower_is_better_direction() -> None:
    base = res("scheduler.least_loaded", [100.0, 105.0, 110.0], better="lower", unit="us")
    slower = res("scheduler.least_loaded", [150.0, 155.0, 160.0], better="lower", unit="us")
    faster = res("scheduler.least_loaded", [50.0, 55.0, 60.0], better="lower", unit="us")
    assert judge(base, slower).status is Status.REGRESSED
    assert judge(base, faster).status is Status.IMPROVED


def test_overlapping_spreads_are_not_flagged_even_when_the_median_moved_a_lot() -> None:
    # medians 2.0 -> 3.5 (+75%), but the ranges [1, 3] and [2.5, 4] overlap: within the runs' own noise
    assert judge(res("x.y", [1.0, 2.0, 3.0]), res("x.y", [2.5, 3.5, 4.0])).status is Status.OK
    assert judge(res("x.y", [2.5, 3.5, 4.0]), res("x.y", [1.0, 2.0, 3.0])).status is Status.OK


def test_disjoint_but_within_tolerance_is_not_flagged_unless_the_tolerance_is_smaller() -> None:
    base, cur = res("x.y", [1.00, 1.01, 1.02]), res("x.y", [0.95, 0.96, 0.97])  # -5%, ranges disjoint
    assert judge(base, cur, tolerance=0.10).status is Status.OK
    assert judge(base, cur, tolerance=0.02).status is Status.REGRESSED


def test_touching_ranges_count_as_overlapping() -> None:
    assert judge(res("x.y", [1.0, 1.0, 2.0]), res("x.y", [0.1, 0.5, 1.0]), tolerance=0.0).status is Status.OK


def test_unit_or_direction_change_is_incomparable() -> None:
    v = judge(res("x.y", [1.0, 1.0]), res("x.y", [1.0, 1.0], unit="us"))
    assert v.status is Status.INCOMPARABLE and "GB/s" in v.detail and "us" in v.detail
    assert judge(res("x.y", [1.0, 1.0]), res("x.y", [1.0, 1.0], better="lower")).status is Status.INCOMPARABLE


def test_negative_tolerance_is_refused() -> None:
    with pytest.raises(ValueError, match="tolerance"):
        judge(res("x.y", [1.0, 1.0]), res("x.y", [1.0, 1.0]), tolerance=-0.1)


# ------------------------------------------------------------------ whole runs
def test_missing_results_are_reported_with_the_reason_and_are_not_regressions() -> None:
    baseline = run_of(res("codec.int8.encode", [1.0, 1.0]), res("codec.fp8.encode", [1.0, 1.0]),
                      res("redis.list", [5.0, 5.0], better="lower", unit="us"),
                      res("engine.prefill", [1.0, 1.1]))
    current = run_of(res("codec.int8.encode", [1.0, 1.0]), benchmarks=["codec", "engine"],
                     errors={"engine": "TransformersMissing: not installed"})
    verdicts = {v.name: v for v in compare(baseline, current)}
    assert verdicts["codec.int8.encode"].status is Status.OK
    assert verdicts["codec.fp8.encode"].status is Status.MISSING
    assert "no longer produces" in verdicts["codec.fp8.encode"].detail
    assert verdicts["redis.list"].status is Status.MISSING and "not run" in verdicts["redis.list"].detail
    assert verdicts["engine.prefill"].status is Status.MISSING
    assert "failed" in verdicts["engine.prefill"].detail and "TransformersMissing" in verdicts["engine.prefill"].detail
    assert regressions(list(verdicts.values())) == []


def test_new_results_are_reported() -> None:
    verdicts = compare(run_of(res("a.x", [1.0, 1.0])), run_of(res("a.x", [1.0, 1.0]), res("a.z", [2.0, 2.0])))
    assert [(v.name, v.status) for v in verdicts] == [("a.x", Status.OK), ("a.z", Status.NEW)]


def test_regressions_are_named_in_the_table() -> None:
    baseline = run_of(res("codec.int8.encode", [1.0, 1.01, 1.02]), res("redis.list", [5.0, 5.1], "lower", "us"))
    current = run_of(res("codec.int8.encode", [0.5, 0.51, 0.52]), res("redis.list", [5.0, 5.2], "lower", "us"))
    verdicts = compare(baseline, current)
    assert [v.name for v in regressions(verdicts)] == ["codec.int8.encode"]
    text = format_verdicts(verdicts, "base.json")
    assert "base.json" in text
    assert "REGRESSED: codec.int8.encode" in text
    assert "1 ok, 1 regressed" in text


# ------------------------------------------------------------------ the JSON file
def test_json_round_trip(tmp_path: Path) -> None:
    run = run_of(res("codec.int8.encode", [0.1, 0.2, 0.3]), res("redis.list", [5.0, 6.0], "lower", "us"),
                 errors={"engine": "boom"}, benchmarks=["codec", "redis", "engine"])
    path = tmp_path / "r.json"
    run.write(path)
    raw = json.loads(path.read_text())
    assert raw["schema"] == SCHEMA
    assert raw["results"][0]["ratio"] == {"min": 0.1, "median": 0.2, "max": 0.3}
    back = SuiteRun.read(path)
    assert back.results == run.results
    assert back.errors == run.errors and back.benchmarks == ["codec", "redis", "engine"]


@pytest.mark.parametrize("content, message", [
    ("not json", "not valid JSON"),
    ('{"schema": "other/1", "results": []}', "not an `epd bench micro` results file"),
    ('[1, 2]', "not an `epd bench micro` results file"),
    (json.dumps({"schema": SCHEMA, "results": [{"name": "x"}]}), "malformed results"),
    (json.dumps({"schema": SCHEMA, "results": [{"name": "x", "benchmark": "x", "unit": "us", "better": "lower",
                                                "reference": "r", "values": [1.0], "ref_values": [0.0]}]}),
     "must be positive"),
])
def test_bad_results_files_get_a_clear_error(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "base.json"
    path.write_text(content)
    with pytest.raises(ResultsFileError, match=message) as info:
        SuiteRun.read(path)
    assert str(path) in str(info.value)


def test_missing_results_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ResultsFileError, match="cannot read .*nope.json"):
        SuiteRun.read(tmp_path / "nope.json")


def test_result_rejects_inconsistent_figures() -> None:
    with pytest.raises(ValueError, match="values vs"):
        Result("a.b", "a", "us", "lower", "r", (1.0, 2.0), (1.0,))
    with pytest.raises(ValueError, match="positive"):
        Result("a.b", "a", "us", "lower", "r", (float("nan"),), (1.0,))
    with pytest.raises(ValueError, match="better"):
        Result("a.b", "a", "us", "faster", "r", (1.0,), (1.0,))  # type: ignore[arg-type]  # refused


# ------------------------------------------------------------------ selection and timing helpers
def test_select_keeps_suite_order_and_names_valid_benchmarks_on_error() -> None:
    assert [b.name for b in select(["redis", "codec"])] == ["codec", "redis"]
    assert [b.name for b in select(None)] == list(NAMES)
    with pytest.raises(UnknownBenchmark) as info:
        select(["codec", "bogus"])
    assert "'bogus'" in str(info.value) and all(n in str(info.value) for n in NAMES)


def test_plan_needs_two_repeats_for_a_spread() -> None:
    with pytest.raises(ValueError, match="repeats"):
        Plan(repeats=1)
    with pytest.raises(ValueError, match="clock"):
        Plan(clock="sundial")  # type: ignore[arg-type]  # refused


def test_best_takes_the_minimum_of_at_least_tries_calls() -> None:
    costs = iter([5.0, 3.0, 4.0, 1.0])
    assert best(lambda: next(costs), tries=3) == 3.0  # the 4th value is never drawn
    assert next(costs) == 1.0


def test_paired_alternates_which_side_goes_first() -> None:
    order: list[str] = []

    def side(name: str, cost: float):
        def fn() -> float:
            order.append(name)
            return cost
        return fn

    figs, refs = paired(side("f", 2.0), side("r", 1.0), Plan(repeats=3, inner=1, min_side_s=0.0))
    assert figs == [2.0, 2.0, 2.0] and refs == [1.0, 1.0, 1.0]
    assert order == ["f", "r", "r", "f", "f", "r"]


def test_setup_differences_are_named() -> None:
    from bench.micro.compare import setup_differences

    a = SuiteRun(meta={"quick": True, "clock": "cpu", "torch_threads": 1, "model": "demo"})
    b = SuiteRun(meta={"quick": True, "clock": "wall", "torch_threads": 2, "model": "demo"})
    assert setup_differences(a, a) == []
    diffs = setup_differences(a, b)
    assert len(diffs) == 2 and "clock" in diffs[0] and "'wall'" in diffs[0] and "threads" in diffs[1]
