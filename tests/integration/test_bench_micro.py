"""``epd bench micro`` end to end through the CLI: real benchmarks (the scheduler's real WorkerView, a real
private redis-server), the JSON file, and ``--compare`` flagging a doctored baseline.

No speed is asserted: only that figures and ratios exist, are positive, and that the comparison logic acts
on them. Each run is a separate ``python -m controlplane.cli`` process, as a user would run it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from bench.micro.results import SCHEMA, SuiteRun

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]
CHEAP = ["--only", "scheduler", "--only", "redis", "--quick"]  # both forms of --only: repeated and comma list


def micro(*args: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controlplane.cli", "bench", "micro", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("micro") / "baseline.json"
    proc = micro(*CHEAP, "--json", str(path))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "scheduler.least_loaded" in proc.stdout and "redis.heartbeat" in proc.stdout  # the table
    assert "scheduler.prefix_affinity is the decision with a 100,000-block prefix index" in proc.stdout
    return path


def test_json_holds_figures_and_ratios(first_run: Path) -> None:
    raw = json.loads(first_run.read_text())
    assert raw["schema"] == SCHEMA
    assert raw["benchmarks"] == ["scheduler", "redis"] and raw["errors"] == {}
    assert raw["meta"]["quick"] is True and raw["meta"]["repeats"] == 3
    names = {r["name"] for r in raw["results"]}
    assert {"scheduler.least_loaded", "scheduler.round_robin", "scheduler.prefix_affinity", "redis.register",
            "redis.heartbeat", "redis.list"} <= names
    for r in raw["results"]:
        assert len(r["values"]) == len(r["ref_values"]) == len(r["ratios"]) == 3
        assert all(v > 0 for v in r["values"] + r["ref_values"] + r["ratios"]), r
        assert r["ratio"]["min"] <= r["ratio"]["median"] <= r["ratio"]["max"]
        assert r["reference"] and r["unit"] in ("us", "GB/s", "tok/s")
    SuiteRun.read(first_run)  # and it loads back as a baseline


def test_compare_flags_a_doctored_regression_and_exits_nonzero(first_run: Path, tmp_path: Path) -> None:
    raw = json.loads(first_run.read_text())
    target = next(r for r in raw["results"] if r["name"] == "scheduler.least_loaded")
    assert target["better"] == "lower"
    # The baseline claims the decision once cost a thousandth of what it does now, relative to the same
    # empty call: today's run must look like a regression far beyond any spread.
    target["values"] = [v / 1000 for v in target["values"]]
    # And a result of a benchmark this run does not select: reported missing, not a regression.
    raw["results"].append({"name": "codec.int8.encode", "benchmark": "codec", "unit": "GB/s", "better": "higher",
                           "reference": "memcpy", "values": [1.0, 1.1], "ref_values": [10.0, 10.0]})
    doctored = tmp_path / "doctored.json"
    doctored.write_text(json.dumps(raw))
    current = tmp_path / "current.json"
    proc = micro("--only", "scheduler,redis", "--quick", "--compare", str(doctored), "--json", str(current))
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "REGRESSED: scheduler.least_loaded" in proc.stdout
    assert "regressed beyond their spread: scheduler.least_loaded" in proc.stderr
    assert "codec.int8.encode" in proc.stdout and "was not run (--only)" in proc.stdout
    assert json.loads(current.read_text())["errors"] == {}  # the run itself was fine


def test_unknown_benchmark_names_the_valid_ones() -> None:
    proc = micro("--only", "scheduler,nope", timeout=60)
    assert proc.returncode == 2
    assert "unknown benchmark 'nope'" in proc.stderr
    assert "codec, kv-grpc, kv-tcp, kv-shm, scheduler, engine, engine-loop, redis" in proc.stderr


def test_a_bad_baseline_is_refused_before_anything_runs(tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"schema": "something-else"}')
    proc = micro("--only", "redis", "--compare", str(bad), timeout=60)
    assert proc.returncode == 2
    assert "--compare" in proc.stderr and "not an `epd bench micro` results file" in proc.stderr
    assert "[micro] redis" not in proc.stderr  # nothing was measured


def _children() -> list[str]:
    """Command names of this process's live child processes (from /proc)."""
    import os

    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            name, rest = stat[stat.index("(") + 1:stat.rindex(")")], stat[stat.rindex(")") + 2:].split()
            if int(rest[1]) == os.getpid() and rest[0] != "Z":
                out.append(name)
    return out


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads /proc")
def test_redis_benchmark_in_process_leaves_no_server_behind() -> None:
    from bench.micro.runner import run_suite, select
    from bench.micro.timing import Plan

    before = _children()
    run = run_suite(select(["redis"]), Plan(repeats=2, quick=True))
    assert run.errors == {}
    assert {r.name for r in run.results} == {"redis.register", "redis.heartbeat", "redis.list"}
    assert _children() == before  # the private redis-server was stopped


@pytest.mark.slow
@pytest.mark.transformers
def test_whole_suite_smoke_run(tmp_path: Path) -> None:
    """The CI smoke run: every benchmark at --quick sizes and the fewest repeats, no thresholds; all must produce
    results."""
    pytest.importorskip("transformers")
    path = tmp_path / "all.json"
    proc = micro("--quick", "--repeats", "2", "--json", str(path), timeout=420)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    raw = json.loads(path.read_text())
    assert raw["errors"] == {}
    assert raw["benchmarks"] == ["codec", "kv-grpc", "kv-tcp", "kv-shm", "scheduler", "engine", "engine-loop",
                                 "redis", "tracing", "sampler", "detokenizer"]
    names = {r["name"] for r in raw["results"]}
    for codec in ("bf16", "fp8", "int8", "int4.key", "int4.value", "fp32"):
        assert {f"codec.{codec}.encode", f"codec.{codec}.decode"} <= names
    assert {"kv-grpc.bf16", "kv-grpc.bf16.vs-tcp", "kv-grpc.int8", "kv-tcp.int8", "kv-tcp.int8-kept", "kv-tcp.bf16",
            "kv-shm.bf16",
            "engine.prefill",
            "engine.decode.b1", "engine.decode.b8", "engine.decode.b32", "engine-loop.handoff",
            "engine-loop.run_here", "tracing.span", "tracing.encode", "sampler.b1", "sampler.b32",
            "detokenizer.t512"} <= names
    assert all(x > 0 for r in raw["results"] for x in r["ratios"])
