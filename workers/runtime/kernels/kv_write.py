"""The KV write in Triton: one step's k/v into the paged cache, quantised when the layer is.

Same contract as ``KVLayerStorage.write``: k, v are [T, kv_heads, head_dim] in the compute dtype,
slots [T] int64. A slot < 0 (a padded row of a CUDA-graph bucket) writes nothing. Quantised layers
store round-half-to-even(x / s) (int8) or the e4m3 cast of x / s (fp8) with s = max(|x|) / qmax per
(token, head), max(|x|) floored at 1e-12, exactly as ``QuantizedLayerStorage`` does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from workers.runtime.kernels.cache_views import DENSE, CacheTensors, scale_args
from workers.runtime.kernels.fp8 import f32_to_e4m3, rint


@triton.jit
def _write_one(x_ptr, c_ptr, s_ptr, t, slot, stride_xt, stride_xh, stride_cs, stride_ch, stride_ss,
               h, d, mask, hmask, qmax, KIND: tl.constexpr):
    x = tl.load(x_ptr + t * stride_xt + h[:, None] * stride_xh + d[None, :], mask=mask, other=0.0)
    dst = c_ptr + slot * stride_cs + h[:, None] * stride_ch + d[None, :]
    if KIND == 0:
        tl.store(dst, x.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        x = x.to(tl.float32)
        amax = tl.max(tl.abs(x), 1)
        # div_rn: IEEE division as torch does it (a plain / may lower to an approximate divide on GPUs)
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), qmax)
        q = tl.math.div_rn(x, scale[:, None])
        if KIND == 1:
            q = tl.minimum(tl.maximum(rint(q), -qmax), qmax).to(tl.int8)
        else:
            q = f32_to_e4m3(q)
        tl.store(dst, q, mask=mask)
        tl.store(s_ptr + slot * stride_ss + h, scale, mask=hmask)


@triton.jit
def _kv_write_kernel(k_ptr, v_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, qmax,
                     stride_kt, stride_kh, stride_vt, stride_vh, stride_cs, stride_ch, stride_ss,
                     HKV: tl.constexpr, BLOCK_H: tl.constexpr, D: tl.constexpr, BLOCK_D: tl.constexpr,
                     KIND: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    h = tl.arange(0, BLOCK_H)
    d = tl.arange(0, BLOCK_D)
    hmask = (h < HKV) & ((h * 0 + slot) >= 0)
    mask = hmask[:, None] & (d[None, :] < D)
    _write_one(k_ptr, kc_ptr, ks_ptr, t, slot, stride_kt, stride_kh, stride_cs, stride_ch, stride_ss,
               h, d, mask, hmask, qmax, KIND)
    _write_one(v_ptr, vc_ptr, vs_ptr, t, slot, stride_vt, stride_vh, stride_cs, stride_ch, stride_ss,
               h, d, mask, hmask, qmax, KIND)


def write_kv(cache: CacheTensors, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
    """Store k, v ([T, kv_heads, head_dim], unit stride on head_dim) at ``slots`` ([T]; < 0 = skip)."""
    tokens, kv_heads, head_dim = k.shape
    if tokens == 0:
        return
    if k.stride(2) != 1 or v.stride(2) != 1:
        raise ValueError("write_kv needs unit stride on head_dim")
    ks, vs = scale_args(cache)
    _kv_write_kernel[(tokens,)](
        k, v, slots, cache.k, cache.v, ks, vs, cache.qmax,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1), cache.k.stride(0), cache.k.stride(1),
        ks.stride(0) if cache.kind != DENSE else 0,
        HKV=kv_heads, BLOCK_H=triton.next_power_of_2(kv_heads), D=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), KIND=cache.kind)
