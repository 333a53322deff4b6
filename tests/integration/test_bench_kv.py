"""``epd bench kv`` end to end through the CLI, at --quick sizes: every codec and transport pushes to a
real receiver process, the references run, the TTFT figure streams a real prefill, and --paired pairs
pushes with socket transfers. No speed is asserted: figures exist, are positive, and name their
references; bad options are refused by name."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration]

ROOT = Path(__file__).resolve().parents[2]


def bench_kv(*args: str, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "controlplane.cli", "bench", "kv", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def test_quick_run_reports_every_figure_and_the_pairs(tmp_path: Path) -> None:
    out = tmp_path / "kv.json"
    proc = bench_kv("--quick", "--repeats", "1", "--paired", "2", "--ttft-tokens", "256", "--json", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    raw = json.loads(out.read_text())
    names = [f["name"] for f in raw["figures"]]
    for want in ("bf16 over grpc", "int8 over grpc", "fp8 over grpc", "int4 over grpc", "bf16 over tcp",
                 "int8 over tcp", "int8 over tcp, kept int8", "bf16 over shm", "int8 over shm",
                 "int8 over shm, kept int8"):
        assert f"demo 4k-token cache: {want}" in names, names
    assert any(n.startswith("TTFT 256-token prompt") for n in names)
    for layers in ("16 layers", "1 layer"):  # the fixed cost of a push, per transport
        for transport in ("grpc", "tcp", "shm"):
            assert f"1-block cache, {layers}: bf16 over {transport}" in names, names
    assert all(f["value"] > 0 and f["ref_value"] > 0 for f in raw["figures"])
    assert all(f["reference"] in raw["references"] or f["reference"] in raw["latency_references_ms"]
               or f["reference"] == "prefill compute alone" for f in raw["figures"])
    assert raw["latency_references_ms"]["tcp round trip"] > 0 and "tcp round trip" in proc.stdout
    assert [p["name"] for p in raw["paired"]] == ["demo 4k-token cache: int8 over tcp, kept int8",
                                                  "demo 4k-token cache: int8 over tcp, bf16 cache",
                                                  "demo 4k-token cache: int8 over shm, kept int8"]
    assert all(len(p["ratios"]) == 2 and all(r > 0 for r in p["ratios"]) for p in raw["paired"])
    assert "paired with its reference" in proc.stdout and "kept int8" in proc.stdout


def test_a_negative_pair_count_is_refused_by_name() -> None:
    proc = bench_kv("--quick", "--paired", "-1", timeout=120)
    assert proc.returncode != 0
    assert "--paired must be 0 or more" in proc.stderr + proc.stdout


def test_paired_only_runs_just_the_pairs(tmp_path: Path) -> None:
    out = tmp_path / "paired.json"
    proc = bench_kv("--quick", "--paired-only", "--paired", "2", "--json", str(out), timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [len(p["ratios"]) for p in json.loads(out.read_text())["paired"]] == [2, 2, 2]
    assert "paired with its reference" in proc.stdout and "over 2" in proc.stdout
    assert "grpc raw stream" not in proc.stdout and "TTFT" not in proc.stdout  # nothing else ran
