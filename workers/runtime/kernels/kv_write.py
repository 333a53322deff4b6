"""The KV write in Triton: one step's k/v into the paged cache, quantised when the layer is; and the
same write fused with RoPE (``rope_write_kv``), which is what the decoder runs.

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
from workers.runtime.kernels.fused import EXACT, rotate


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
        BLOCK_D=triton.next_power_of_2(head_dim), KIND=cache.kind, **EXACT)


@triton.jit
def quantize_codes(x, scale, qmax, KIND: tl.constexpr):
    q = tl.math.div_rn(x, scale)
    if KIND == 1:
        out = tl.minimum(tl.maximum(rint(q), -qmax), qmax).to(tl.int8)
    else:
        out = f32_to_e4m3(q)
    return out


@triton.jit
def _store_head(c_ptr, s_ptr, slot, kh, lo, hi, i, mask, stride_cs, stride_ch, stride_ss, qmax,
                HALF: tl.constexpr, KIND: tl.constexpr):
    """Store one head given as halves (lo, hi) at ``slot``; masked-off lanes hold 0."""
    dst = c_ptr + slot * stride_cs + kh * stride_ch
    if KIND == 0:
        tl.store(dst + i, lo.to(c_ptr.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + i, hi.to(c_ptr.dtype.element_ty), mask=mask)
    else:
        lo = lo.to(tl.float32)
        hi = hi.to(tl.float32)
        amax = tl.maximum(tl.max(tl.abs(lo), 0), tl.max(tl.abs(hi), 0))
        scale = tl.math.div_rn(tl.maximum(amax, 1e-12), qmax)
        tl.store(dst + i, quantize_codes(lo, scale, qmax, KIND), mask=mask)
        tl.store(dst + HALF + i, quantize_codes(hi, scale, qmax, KIND), mask=mask)
        # the scale goes through lane 0, so the store is masked like the data (slot < 0: nothing)
        tl.store(s_ptr + slot * stride_ss + kh + i * 0, scale + i * 0.0, mask=mask & (i == 0))


@triton.jit
def _rope_kv_kernel(qk_ptr, v_ptr, cos_ptr, sin_ptr, slot_ptr, kc_ptr, vc_ptr, ks_ptr, vs_ptr, qmax,
                    stride_qt, stride_qh, stride_vt, stride_vh, stride_ct, stride_cs, stride_ch, stride_ss,
                    H: tl.constexpr, HKV: tl.constexpr, HALF: tl.constexpr, BLOCK: tl.constexpr,
                    KIND: tl.constexpr):
    # One program per (token, head) over q heads, then k heads (rotated and written), then v heads.
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    i = tl.arange(0, BLOCK)
    m = i < HALF
    slot = tl.load(slot_ptr + t).to(tl.int64)
    wmask = m & ((i * 0 + slot) >= 0)
    if h < H + HKV:
        base = qk_ptr + t * stride_qt + h * stride_qh
        x1 = tl.load(base + i, mask=m, other=0.0)
        x2 = tl.load(base + HALF + i, mask=m, other=0.0)
        c1 = tl.load(cos_ptr + t * stride_ct + i, mask=m, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + t * stride_ct + HALF + i, mask=m, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + t * stride_ct + i, mask=m, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + t * stride_ct + HALF + i, mask=m, other=0.0).to(tl.float32)
        lo, hi = rotate(x1, x2, c1, c2, s1, s2, qk_ptr.dtype.element_ty)
        tl.store(base + i, lo, mask=m)
        tl.store(base + HALF + i, hi, mask=m)
        if h >= H:
            _store_head(kc_ptr, ks_ptr, slot, h - H, lo, hi, i, wmask, stride_cs, stride_ch, stride_ss, qmax,
                        HALF, KIND)
    else:
        kh = h - H - HKV
        base = v_ptr + t * stride_vt + kh * stride_vh
        lo = tl.load(base + i, mask=m, other=0.0)
        hi = tl.load(base + HALF + i, mask=m, other=0.0)
        _store_head(vc_ptr, vs_ptr, slot, kh, lo, hi, i, wmask, stride_cs, stride_ch, stride_ss, qmax, HALF, KIND)


def rope_write_kv(cache: CacheTensors, slots: torch.Tensor, qk: torch.Tensor, v: torch.Tensor, cos: torch.Tensor,
                  sin: torch.Tensor, num_heads: int) -> None:
    """RoPE in place on qk ([T, num_heads + kv_heads, head_dim]: the q heads, then the k heads), then the
    rotated k and v ([T, kv_heads, head_dim]) stored at ``slots`` as ``write_kv`` stores them.
    cos, sin: [T, 1, head_dim] in qk's dtype."""
    tokens, heads, head_dim = qk.shape
    kv_heads = heads - num_heads
    if tokens == 0:
        return
    if qk.stride(2) != 1 or v.stride(2) != 1 or head_dim % 2:
        raise ValueError("rope_write_kv needs unit stride on an even head_dim")
    ks, _ = scale_args(cache)
    half = head_dim // 2
    _rope_kv_kernel[(tokens, heads + kv_heads)](
        qk, v, cos, sin, slots, cache.k, cache.v, ks, scale_args(cache)[1], cache.qmax,
        qk.stride(0), qk.stride(1), v.stride(0), v.stride(1), cos.stride(0), cache.k.stride(0), cache.k.stride(1),
        ks.stride(0) if cache.kind != DENSE else 0,
        H=num_heads, HKV=kv_heads, HALF=half, BLOCK=triton.next_power_of_2(half), KIND=cache.kind, **EXACT)
