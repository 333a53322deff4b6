"""The engine's Triton kernels compile for a Hopper GPU (sm_90) without one (the interpreter does not
catch everything the compiler refuses), attention uses the tensor cores in bf16, and the small ops that
must round as torch does have no fused multiply-add and no approximate division in their PTX."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

from tests.unit.compiled_subprocess import ROOT, run_json, run_json_together

# Not imported here: importing triton before tests.unit.triton_env sets TRITON_INTERPRET would make the
# interpreter tests that run later in this process compile their kernels.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
pytestmark = pytest.mark.unit


def test_kernels_compile_for_sm90_and_the_small_ops_round_as_torch() -> None:
    counts = run_json([str(ROOT / "tests" / "unit" / "triton_compile_probe.py")], timeout=300)
    assert len(counts) == 16
    for name in ("decode bf16", "prefill bf16", "split fp8", "decode int8"):
        assert counts[name]["mma"] > 0, f"{name}: bf16 attention should run on the tensor cores"
    for name, c in counts.items():
        assert c["cvt.rz."] == 0, f"{name}: a float conversion rounds toward zero, torch's rounds to nearest"
        if name.startswith(("kv_write", "rope", "rmsnorm", "silu")):
            assert c["fma."] == 0, f"{name}: a fused multiply-add rounds differently from torch"
            assert c["div.full"] == 0 and c["div.approx"] == 0, f"{name}: approximate division"


@pytest.mark.slow
def test_every_launch_of_the_1b_preset_compiles_for_sm90(tmp_path: Path) -> None:
    """The specialisations a GPU compiles when gpu-check drives the engine and the codecs at the 1b preset's
    shape and at the CUDA tests' tiny shape (recorded through the interpreter: each argument's dtype, int
    width, value 1, divisibility by 16, each constexpr) all compile for sm_90 and fit a block's shared
    memory, not just the hand-written signatures above."""
    specs = tmp_path / "specs.json"
    probe = str(ROOT / "tests" / "unit" / "triton_launch_probe.py")
    halves = run_json_together([[probe, "preset"], [probe, "rest"]], timeout=900, interpret=True)
    unique = {json.dumps(s, sort_keys=True): s for half in halves for s in half}  # a launch both halves made
    specs.write_text(json.dumps(list(unique.values())))
    names = {s["name"] for s in unique.values()}
    assert {"_decode_kernel", "_split_kernel", "_merge_kernel", "_prefill_kernel", "_rope_kv_kernel", "_rmsnorm_kernel",
            "_silu_mul_kernel", "int8_encode_kernel", "int4_decode_kernel", "fp32_decode_kernel",
            "checksum_kernel"} <= names
    code = ("import json, sys; from triton_launches import compile_all; "
            f"print(json.dumps(compile_all(json.load(open({str(specs)!r})))))")
    failures = run_json(["-c", code], timeout=900, path=(ROOT / "tests" / "unit",))
    assert not failures, "\n".join(failures)
