"""Arithmetic shared by the Triton codec kernels, written to round exactly as the torch codecs do.

Why these helpers: the wire bytes of a Triton encode must equal the torch codec's bit for bit.
- ``_rne``: round half to even through the float32 "magic number" (exact for |v| < 2**22); the
  interpreter has no libdevice ``rint``, and the launches turn fp-fusion off so that no multiply
  before it becomes an FMA with a different rounding.
- Division goes through ``tl.math.div_rn`` (IEEE round-to-nearest), as torch divides; Triton's
  plain ``/`` on float32 is approximate on NVIDIA GPUs.
- fp8 e4m3fn and float16 conversions are done on the bits, as c10 does, so the interpreter and
  every GPU produce the same bytes.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Globals a kernel reads must be constexpr (Triton refuses plain globals inside @jit functions).
TINY = tl.constexpr(1.1754943508222875e-38)  # float32's smallest normal: the scales' floor


@triton.jit
def _rne(v):
    return (v + 12582912.0) - 12582912.0


@triton.jit
def abs_bits_max(x):
    """max over x of its float32 bits with the sign cleared; >= 0x7F800000 means NaN or inf."""
    return tl.max(x.to(tl.int32, bitcast=True) & 0x7FFFFFFF)


@triton.jit
def _to_e4m3(y):
    """float32 in [-448, 448] to e4m3fn codes (int32 0..255), round to nearest even."""
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    a_bits = bits & 0x7FFFFFFF
    a = a_bits.to(tl.float32, bitcast=True)
    sub = _rne(a * 512.0).to(tl.int32)
    norm = ((a_bits + 0x7FFFF + ((a_bits >> 20) & 1)) >> 20) - 960
    code = tl.where(a < 0.015625, sub, norm)
    return code | (sign << 7)


@triton.jit
def from_e4m3(c):
    """e4m3fn codes (int32 0..255) to float32 (NaN for S.1111.111)."""
    sign = (c >> 7) & 1
    e = (c >> 3) & 15
    m = c & 7
    normal = (sign << 31) | ((e + 120) << 23) | (m << 20)
    # the sign goes in as a bit, not by a unary minus: triton < 3.7 lowers -x to 0 - x, which loses -0
    sub = (m.to(tl.float32) * 0.001953125).to(tl.int32, bitcast=True) | (sign << 31)
    bits = tl.where(e == 0, sub, normal)
    return tl.where((c & 0x7F) == 0x7F, 0x7FC00000, bits).to(tl.float32, bitcast=True)


@triton.jit
def _f16_bits(x):
    """float32 -> float16 bits (int32, 0..0xFFFF), round to nearest even; beyond float16's range the
    nearest finite value (the callers' nextafter step then reaches inf, as torch's cast then step does)."""
    x = tl.minimum(tl.maximum(x, -65504.0), 65504.0)
    return x.to(tl.float16).to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF


@triton.jit
def _f16_value(b):
    """float16 bits (int32) -> float32."""
    return b.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _round_down_f16(x):
    """bits of the largest float16 <= x (as torch.nextafter after a nearest cast)."""
    b = _f16_bits(x)
    over = _f16_value(b) > x
    pos = (b & 0x8000) == 0
    zero = (b & 0x7FFF) == 0
    down = tl.where(zero, 0x8001, tl.where(pos, b - 1, b + 1))
    return tl.where(over, down, b)


@triton.jit
def _round_up_f16(x):
    """bits of the smallest float16 >= x."""
    b = _f16_bits(x)
    under = _f16_value(b) < x
    pos = (b & 0x8000) == 0
    zero = (b & 0x7FFF) == 0
    up = tl.where(zero, 0x0001, tl.where(pos, b + 1, b - 1))
    return tl.where(under, up, b)


@triton.jit
def _bf16_bits(x):
    """float32 -> bf16 bits (int32, 0..0xFFFF), round to nearest even as torch casts; NaN -> 0x7FC0.
    (The interpreter's own cast truncates, so the rounding is done here on the bits.)"""
    u = x.to(tl.int32, bitcast=True)
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    return tl.where(nan, 0x7FC0 | ((u >> 16) & 0x8000), r)


@triton.jit
def _store_out(ptr, y, mask, OUT_BF16: tl.constexpr):
    """Store float32 ``y`` into a float32 destination, or a bf16 one viewed as int16 (rounded by
    ``_bf16_bits``)."""
    if OUT_BF16:
        tl.store(ptr, _bf16_bits(y).to(tl.int16), mask=mask)
    else:
        tl.store(ptr, y, mask=mask)


@triton.jit
def _load_src(src, sscale, off, soff, mask, SRC: tl.constexpr, ROUND_BF16: tl.constexpr):
    """float32 values of a cache tile: SRC 0 reads a float32/bf16 cache at ``src + off``; SRC 1 (int8) and
    2 (fp8 e4m3 codes viewed as uint8) read codes there and multiply each by its (token, head) scale at
    ``sscale + soff``, rounded to bf16 when ROUND_BF16, as the engine's gather of a quantised cache does
    (kvtransfer.codecs.paged). Masked elements read 0."""
    if SRC == 0:
        x = tl.load(src + off, mask=mask, other=0.0).to(tl.float32)
    else:
        c = tl.load(src + off, mask=mask, other=0)
        if SRC == 1:
            q = c.to(tl.float32)
        else:
            q = from_e4m3(c.to(tl.int32) & 0xFF)
        x = q * tl.load(sscale + soff, mask=mask, other=0.0)
        if ROUND_BF16:
            x = (_bf16_bits(x) << 16).to(tl.float32, bitcast=True)
    return x
