"""The engine's Triton kernels compile for a Hopper GPU (sm_90) without one (the interpreter does not
catch everything the compiler refuses), attention uses the tensor cores in bf16, and the small ops that
must round as torch does have no fused multiply-add and no approximate division in their PTX."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_kernels_compile_for_sm90_and_the_small_ops_round_as_torch() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(ROOT / "proto"), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, str(ROOT / "tests" / "unit" / "triton_compile_probe.py")],
                          capture_output=True, text=True, timeout=300, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(counts) == 16
    for name in ("decode bf16", "prefill bf16", "split fp8", "decode int8"):
        assert counts[name]["mma"] > 0, f"{name}: bf16 attention should run on the tensor cores"
    for name, c in counts.items():
        if name.startswith(("kv_write", "rope", "rmsnorm", "silu")):
            assert c["fma."] == 0, f"{name}: a fused multiply-add rounds differently from torch"
            assert c["div.full"] == 0 and c["div.approx"] == 0, f"{name}: approximate division"
