"""The requantising landing kernel (workers.runtime.kernels.kv_requant) compiles for a Hopper GPU (sm_90)
without one, for every received codec into int8 and fp8 layers, and its PTX rounds as the torch path does:
no fused multiply-add (int4's scale-then-zero must round twice) and only round-to-nearest division (the
cache's scale and x / scale). A subprocess compiles it, since the interpreter tests in the same session
switch ``triton.jit`` to interpreted functions."""

from __future__ import annotations

import importlib.util

import pytest

from tests.unit.compiled_subprocess import run_json

# Not imported here: importing the kernel before tests.unit.triton_env sets TRITON_INTERPRET would make the
# interpreter tests that run later in this process compile it instead.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
pytestmark = pytest.mark.unit

_SCRIPT = r'''
import inspect
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from workers.runtime.kernels.cache_views import FP8, INT8
from workers.runtime.kernels.kv_requant import CODECS, requant_kernel

if "constexprs" not in inspect.signature(ASTSource).parameters:  # the ahead-of-time API of Triton >= 3.3
    print(json.dumps({"skip": f"triton {triton.__version__} has another ahead-of-time compile API"}))
    raise SystemExit(0)
payload = {"int8": "*i8", "fp8": "*u8", "int4": "*u8", "bf16": "*i16", "fp32": "*fp32"}
scales = {"int4": "*fp16"}
out = {}
for codec, cid in CODECS.items():
    for kind, codes in ((INT8, "*i8"), (FP8, "*u8")):
        for write in (False, True):
            sig = {"payload": payload[codec], "scales": scales.get(codec, "*fp32"), "zeros": scales.get(codec, "*fp32"),
                   "codes": codes, "cscales": "*fp32", "flag": "*i32", "ids": "*i64", "bs": "i32", "H": "i32",
                   "D": "i32", "G": "i32", "stride_cs": "i64", "stride_ch": "i64", "stride_ss": "i64", "qmax": "fp32"}
            const = {"CODEC": cid, "IS_KEY": codec == "int4", "KIND": kind, "WRITE": write, "BT": 32, "BD": 128}
            sig |= {k: "constexpr" for k in const}
            ptx = triton.compile(ASTSource(fn=requant_kernel, signature=sig, constexprs=const),
                                 target=GPUTarget("cuda", 90, 32), options={"enable_fp_fusion": False}).asm["ptx"]
            out[f"{codec}->{'int8' if kind == INT8 else 'fp8'}{' write' if write else ' check'}"] = {
                k: ptx.count(k) for k in ("fma.", "div.full", "div.approx", "div.rn", "atom.")}
print(json.dumps(out))
'''


def test_kernel_compiles_for_sm90_with_exact_rounding() -> None:
    counts = run_json(["-c", _SCRIPT], timeout=600)
    if "skip" in counts:
        pytest.skip(counts["skip"])
    assert len(counts) == 5 * 2 * 2
    for name, c in counts.items():
        assert c["fma."] == 0, f"{name}: a fused multiply-add rounds differently from the torch path"
        assert c["div.full"] == 0 and c["div.approx"] == 0, f"{name}: approximate division"
        if name.endswith("write"):
            assert c["div.rn"] > 0, f"{name}: the cache's scale and x / scale must divide with round-to-nearest"
        else:
            assert c["atom."] > 0, f"{name}: the check launch raises the refusal flag"
