"""scripts/gpu_check.sh (`make gpu-check`) gets one try on a lent GPU, so its flow is run here, on CPU, in
its dry-run mode with one quick step: the environment line, the wire check, a step that fails, the
summary, the copies to $OUT, and its refusals (no CUDA without a dry run, a step name that is not one)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def _run(tmp_path: Path, **env: str) -> subprocess.CompletedProcess[str]:
    full = os.environ | {"GPU_CHECK_PYTHON": sys.executable, "GPU_CHECK_DIR": str(tmp_path / "check")} | env
    return subprocess.run(["bash", str(ROOT / "scripts" / "gpu_check.sh")], cwd=ROOT, env=full, text=True,
                          capture_output=True, timeout=300)


def test_a_dry_run_of_one_step_ends_in_a_summary_copied_to_out(tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    r = _run(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_STEPS="bench-kv", OUT=str(out))
    assert r.returncode == 1, r.stdout + r.stderr  # the benchmark refuses without CUDA: a failed step
    summary = (out / "summary.txt").read_text()
    assert "gpu-check: dry run without CUDA" in summary
    lines = {line.split()[0]: line for line in summary.splitlines() if line[:1].isalpha() and "  " in line}
    assert "ok" in lines["wire"] and "rc 2" in lines["bench-kv"]  # refused as an input error: exit status 2
    assert not {"kernels", "kv-unit", "kv-cuda", "cuda", "bench", "model"} & set(lines), "only the step asked for"
    assert "--device cuda: no CUDA device is visible here; use --device cpu" in summary
    assert (out / "report.txt").read_text().count("== bench-kv") == 1
    assert not (tmp_path / "check" / "preset-1b").exists(), "no preset written when neither cuda nor bench runs"


def test_without_cuda_and_without_a_dry_run_it_says_so_in_one_line(tmp_path: Path) -> None:
    r = _run(tmp_path, GPU_CHECK_DRY_RUN="0")
    assert r.returncode == 2
    assert r.stdout.strip().splitlines()[-1].startswith("gpu-check: torch ") and "sees no CUDA device" in r.stdout


def test_a_step_that_is_not_one_is_refused(tmp_path: Path) -> None:
    r = _run(tmp_path, GPU_CHECK_DRY_RUN="1", GPU_CHECK_STEPS="kernels,benchkv")
    assert r.returncode == 2
    assert "GPU_CHECK_STEPS names 'benchkv', which is not a step" in r.stdout
