"""Compile the engine's Triton kernels for a Hopper GPU (sm_90) without one and print, per kernel, the
counts of a few PTX instructions as JSON. Run by test_triton_compile.py in a subprocess: Triton compiles
ahead of time with its bundled ptxas, and must not be in interpreter mode."""

from __future__ import annotations

import json
from collections.abc import Mapping

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from workers.runtime.kernels import fused, kv_write
from workers.runtime.kernels import paged_attention as pa
from workers.runtime.kernels import split_decode as sd

TARGET = GPUTarget("cuda", 90, 32)
COUNTED = ("fma.", "div.full", "div.approx", "mma", "cvt.rz.")


def compiled(fn, sig: dict[str, str], const: Mapping[str, object], opts: Mapping[str, object]) -> dict[str, int]:
    sig = sig | {k: "constexpr" for k in const}
    source = ASTSource(fn=fn, signature=sig, constexprs=dict(const))
    ptx = triton.compile(source, target=TARGET, options=dict(opts)).asm["ptx"]
    return {k: ptx.count(k) for k in COUNTED}


def i32(*names: str) -> dict[str, str]:
    return {n: "i32" for n in names}


def attention_sig(q: str, kv: str) -> dict[str, str]:
    return {"q_ptr": q, "k_ptr": kv, "v_ptr": kv, "ks_ptr": "*fp32", "vs_ptr": "*fp32", "bt_ptr": "*i32",
            "lens_ptr": "*i32", "o_ptr": q, "scale": "fp32",
            **i32("stride_qt", "stride_qh", "stride_ks", "stride_kh", "stride_ss", "stride_bt", "stride_ot",
                  "stride_oh")}


def decode_const(kind: int, ieee: bool) -> dict[str, object]:
    return {"G": 8, "BLOCK_G": 16, "D": 64, "BLOCK_D": 64, "BLOCK_SIZE": 16, "BLOCK_N": 64, "KIND": kind,
            "IEEE": ieee}


def main() -> dict[str, dict[str, int]]:
    out = {}
    for name, q, kv, kind, ieee in (("decode bf16", "*bf16", "*bf16", 0, False),
                                    ("decode fp32", "*fp32", "*fp32", 0, True),
                                    ("decode int8", "*bf16", "*i8", 1, False),
                                    ("decode fp8", "*bf16", "*u8", 2, False)):
        out[name] = compiled(pa._decode_kernel, attention_sig(q, kv), decode_const(kind, ieee), pa.FUSED)
    prefill = {k: v for k, v in attention_sig("*bf16", "*bf16").items() if k != "lens_ptr"} | {
        "t_seq_ptr": "*i32", "t_start_ptr": "*i32", "t_count_ptr": "*i32", "t_pos_ptr": "*i32"}
    order = ["q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "bt_ptr", "t_seq_ptr", "t_start_ptr", "t_count_ptr",
             "t_pos_ptr", "o_ptr", "scale"]
    prefill = {k: prefill[k] for k in order} | {k: v for k, v in prefill.items() if k not in order}
    out["prefill bf16"] = compiled(pa._prefill_kernel, prefill, {"G": 8, "D": 64, "BLOCK_D": 64, "BLOCK_M": 16,
                                                                 "BLOCK_SIZE": 16, "BLOCK_N": 64, "KIND": 0,
                                                                 "IEEE": False}, pa.FUSED)
    split = {k: v for k, v in attention_sig("*bf16", "*u8").items() if k not in ("o_ptr", "stride_ot", "stride_oh")}
    split_order = ["q_ptr", "k_ptr", "v_ptr", "ks_ptr", "vs_ptr", "bt_ptr", "lens_ptr"]
    split = {k: split[k] for k in split_order} | {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                                                  "scale": "fp32"} | {
        k: v for k, v in split.items() if k.startswith("stride")}
    out["split fp8"] = compiled(sd._split_kernel, split, {"H": 32, "G": 8, "BLOCK_G": 16, "D": 64, "BLOCK_D": 64,
                                                          "BLOCK_SIZE": 16, "BLOCK_N": 64, "SPLITS": 16, "KIND": 2,
                                                          "IEEE": False}, pa.FUSED)
    out["merge"] = compiled(sd._merge_kernel, {"m_ptr": "*fp32", "l_ptr": "*fp32", "acc_ptr": "*fp32",
                                               "o_ptr": "*bf16", **i32("stride_ot", "stride_oh")},
                            {"H": 32, "D": 64, "BLOCK_D": 64, "SPLITS": 16, "BLOCK_S": 16}, pa.FUSED)
    for kind, cache in ((0, "*bf16"), (1, "*i8"), (2, "*u8")):
        write = {"k_ptr": "*bf16", "v_ptr": "*bf16", "slot_ptr": "*i64", "kc_ptr": cache, "vc_ptr": cache,
                 "ks_ptr": "*fp32", "vs_ptr": "*fp32", "qmax": "fp32",
                 **i32("stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_cs", "stride_ch", "stride_ss")}
        out[f"kv_write {kind}"] = compiled(kv_write._kv_write_kernel, write,
                                          {"HKV": 4, "BLOCK_H": 4, "D": 64, "BLOCK_D": 64, "KIND": kind}, fused.EXACT)
        rope = {"qk_ptr": "*bf16", "v_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16", "slot_ptr": "*i64",
                "kc_ptr": cache, "vc_ptr": cache, "ks_ptr": "*fp32", "vs_ptr": "*fp32", "qmax": "fp32",
                **i32("stride_qt", "stride_qh", "stride_vt", "stride_vh", "stride_ct", "stride_cs", "stride_ch",
                      "stride_ss")}
        out[f"rope_kv {kind}"] = compiled(kv_write._rope_kv_kernel, rope,
                                         {"H": 32, "HKV": 4, "HALF": 32, "BLOCK": 32, "KIND": kind}, fused.EXACT)
    out["rmsnorm"] = compiled(fused._rmsnorm_kernel, {"x_ptr": "*bf16", "r_ptr": "*bf16", "w_ptr": "*bf16",
                                                      "h_ptr": "*bf16", "o_ptr": "*bf16", "n": "i32", "eps": "fp32",
                                                      **i32("stride_x", "stride_r", "stride_h", "stride_o")},
                              {"BLOCK": 2048, "RESIDUAL": True}, fused.EXACT)
    out["rope"] = compiled(fused._rope_kernel, {"x_ptr": "*bf16", "cos_ptr": "*bf16", "sin_ptr": "*bf16",
                                                **i32("stride_xt", "stride_xh", "stride_ct")},
                           {"HALF": 32, "BLOCK": 32}, fused.EXACT)
    out["silu"] = compiled(fused._silu_mul_kernel, {"x_ptr": "*bf16", "o_ptr": "*bf16", "n": "i32",
                                                    **i32("stride_x", "stride_o")}, {"BLOCK": 1024}, fused.EXACT)
    return out


if __name__ == "__main__":
    print(json.dumps(main()))
