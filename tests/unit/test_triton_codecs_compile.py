"""The fused codec kernels (and the device checksum's) compile for a Hopper GPU (sm_90) without one, and
their PTX rounds as the torch codecs do: no fused multiply-add (``enable_fp_fusion`` off, as
``fused._launch`` passes it) and no approximate division. Triton compiles ahead of time with its bundled
ptxas; a subprocess runs it, since the interpreter tests in the same session switch ``triton.jit`` to
interpreted functions."""

from __future__ import annotations

import importlib.util

import pytest

from tests.unit.compiled_subprocess import run_json

# Not imported here: importing triton before tests.unit.triton_env sets TRITON_INTERPRET would make the
# interpreter tests that run later in this process compile their kernels instead.
if importlib.util.find_spec("triton") is None:
    pytest.skip("triton is not installed", allow_module_level=True)
pytestmark = pytest.mark.unit

_SCRIPT = r'''
import json
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvtransfer import triton_checksum as kc
from kvtransfer.codecs import triton_bf16 as kb, triton_fp32 as kf, triton_int4 as k4, triton_int8_fp8 as k8

rows = {"bs": "i32", "H": "i32", "D": "i32"}
strides = {"sb": "i64", "st": "i64", "sh": "i64", "sd": "i64"}
sstrides = {"ssb": "i64", "sst": "i64", "ssh": "i64"}
src_meta = {"SRC": "constexpr", "ROUND_BF16": "constexpr"}
g = {"G": "i32"}
cases = [
    (k8.int8_encode_kernel, {"src": "*bf16", "sscale": "*bf16", "ids": "*i64", "payload": "*i8", "scales": "*fp32",
                             **rows, **strides, **sstrides, "BT": "constexpr", "BD": "constexpr", "SRC": "constexpr",
                             "ROUND_BF16": "constexpr"}, {"BT": 32, "BD": 128, "SRC": 0, "ROUND_BF16": False}),
    (k8.int8_decode_kernel, {"payload": "*i8", "scales": "*fp32", "dst": "*i16", "ids": "*i64", **rows, **strides,
                             "BT": "constexpr", "BD": "constexpr", "OUT_BF16": "constexpr"},
     {"BT": 32, "BD": 128, "OUT_BF16": True}),
    (k8.fp8_encode_kernel, {"src": "*u8", "sscale": "*fp32", "ids": "*i64", "payload": "*u8", "scales": "*fp32",
                            **rows, **strides, **sstrides, "BT": "constexpr", "BE": "constexpr", "SRC": "constexpr",
                            "ROUND_BF16": "constexpr"}, {"BT": 4, "BE": 1024, "SRC": 2, "ROUND_BF16": True}),
    (k8.fp8_encode_kernel, {"src": "*fp32", "sscale": "*fp32", "ids": "*i64", "payload": "*u8", "scales": "*fp32",
                            **rows, **strides, **sstrides, "BT": "constexpr", "BE": "constexpr", **src_meta},
     {"BT": 4, "BE": 1024, "SRC": 0, "ROUND_BF16": False}),
    (k8.int8_encode_kernel, {"src": "*i8", "sscale": "*fp32", "ids": "*i64", "payload": "*i8", "scales": "*fp32",
                             **rows, **strides, **sstrides, "BT": "constexpr", "BD": "constexpr", "SRC": "constexpr",
                             "ROUND_BF16": "constexpr"}, {"BT": 32, "BD": 128, "SRC": 1, "ROUND_BF16": False}),
    (k8.fp8_decode_kernel, {"payload": "*u8", "scales": "*fp32", "dst": "*fp32", "ids": "*i64", **rows, **strides,
                            "BT": "constexpr", "BE": "constexpr", "OUT_BF16": "constexpr"},
     {"BT": 4, "BE": 1024, "OUT_BF16": False}),
    (k4.int4_key_encode_kernel, {"src": "*bf16", "sscale": "*bf16", "ids": "*i64", "payload": "*u8",
                                 "scales": "*i16", "zeros": "*i16", "flags": "*i32", **rows, **g, **strides,
                                 **sstrides, "BG": "constexpr", "BJ": "constexpr", **src_meta},
     {"BG": 16, "BJ": 64, "SRC": 0, "ROUND_BF16": False}),
    (k4.int4_value_encode_kernel, {"src": "*i8", "sscale": "*fp32", "ids": "*i64", "payload": "*u8", "scales": "*i16",
                                   "zeros": "*i16", "flags": "*i32", **rows, **g, **strides, **sstrides,
                                   "BT": "constexpr", "BN": "constexpr", "BH": "constexpr", **src_meta},
     {"BT": 16, "BN": 4, "BH": 16, "SRC": 1, "ROUND_BF16": True}),
    (k4.int4_decode_kernel, {"payload": "*u8", "scales": "*fp16", "zeros": "*fp16", "dst": "*fp32", "ids": "*i64",
                             **rows, **g, "IS_KEY": "constexpr", **strides, "BT": "constexpr", "BJ": "constexpr",
                             "OUT_BF16": "constexpr"}, {"IS_KEY": False, "BT": 8, "BJ": 64, "OUT_BF16": False}),
    (kb.bf16_encode_kernel, {"src": "*fp32", "sscale": "*fp32", "ids": "*i64", "payload": "*i16", "flags": "*i32",
                             **rows, **strides, **sstrides, "BT": "constexpr", "BE": "constexpr",
                             "IN_BF16": "constexpr", **src_meta},
     {"BT": 4, "BE": 1024, "IN_BF16": False, "SRC": 0, "ROUND_BF16": False}),
    (kb.bf16_decode_kernel, {"payload": "*i16", "dst": "*fp32", "ids": "*i64", **rows, **strides, "BT": "constexpr",
                             "BE": "constexpr", "OUT_BF16": "constexpr"}, {"BT": 4, "BE": 1024, "OUT_BF16": False}),
    (kf.fp32_encode_kernel, {"src": "*u8", "sscale": "*fp32", "ids": "*i64", "payload": "*i32", "flags": "*i32",
                             **rows, **strides, **sstrides, "BT": "constexpr", "BE": "constexpr",
                             "IN_BF16": "constexpr", **src_meta},
     {"BT": 4, "BE": 1024, "IN_BF16": False, "SRC": 2, "ROUND_BF16": False}),
    (kf.fp32_decode_kernel, {"payload": "*i32", "dst": "*i16", "ids": "*i64", **rows, **strides, "BT": "constexpr",
                             "BE": "constexpr", "OUT_BF16": "constexpr"}, {"BT": 4, "BE": 1024, "OUT_BF16": True}),
    (kc.checksum_kernel, {"words": "*i32", "partial": "*i64", "n_words": "i32", "BLOCK": "constexpr"}, {"BLOCK": 4096}),
]
import inspect
if "constexprs" not in inspect.signature(ASTSource).parameters:  # the ahead-of-time API of Triton >= 3.3
    print(json.dumps({"skip": f"triton {triton.__version__} has another ahead-of-time compile API"}))
    raise SystemExit(0)
out = {}
for fn, sig, const in cases:
    ptx = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options={"enable_fp_fusion": False}).asm["ptx"]
    name = fn.__name__ + ("_from_quantised" if const.get("SRC") else "")
    out[name] = {k: ptx.count(k) for k in ("fma.", "div.full", "div.approx", "div.rn")}
print(json.dumps(out))
'''


def test_kernels_compile_for_sm90_with_exact_rounding() -> None:
    counts = run_json(["-c", _SCRIPT], timeout=300)
    if "skip" in counts:
        pytest.skip(counts["skip"])
    assert len(counts) == 14
    for name, c in counts.items():
        assert c["fma."] == 0, f"{name}: a fused multiply-add rounds differently from the torch codec"
        assert c["div.full"] == 0 and c["div.approx"] == 0, f"{name}: approximate division"
    for name in ("int8_encode_kernel", "int8_encode_kernel_from_quantised", "fp8_encode_kernel",
                 "fp8_encode_kernel_from_quantised", "int4_key_encode_kernel"):
        assert counts[name]["div.rn"] > 0, f"{name}: scales must be divided with round-to-nearest"
