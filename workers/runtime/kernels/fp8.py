"""float8 e4m3fn <-> float32 in integer arithmetic, for the cache kernels.

Done by hand rather than with Triton's fp8 types so the kernels run on GPUs without native e4m3
conversions (before sm_89) and agree bit for bit with torch under the interpreter, whose own fp8
rounding differs. The cache never holds NaN (the quantiser keeps |x / scale| <= 448), so NaN is not
handled.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def rint(x):
    """Round half to even, as torch.round does; floor-based so every backend agrees."""
    r = tl.floor(x + 0.5)
    tie = (r - x) == 0.5
    odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
    return tl.where(tie & odd, r - 1.0, r)


@triton.jit
def e4m3_to_f32(byte):
    """uint8 e4m3fn bit patterns -> float32 values."""
    b = byte.to(tl.int32)
    sign = (b >> 7) & 1
    exp = (b >> 3) & 0xF
    man = b & 7
    normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
    subnormal = man.to(tl.float32) * 0.001953125 * (1.0 - 2.0 * sign.to(tl.float32))  # man * 2^-9
    return tl.where(exp > 0, normal, subnormal)


@triton.jit
def f32_to_e4m3(x):
    """float32 values with |x| <= 448 -> uint8 e4m3fn bit patterns, rounded to nearest, ties to even
    (torch's cast)."""
    bits = x.to(tl.int32, bitcast=True)
    exp = ((bits >> 23) & 0xFF) - 127
    quantum = ((tl.maximum(exp, -6) - 3 + 127) << 23).to(tl.float32, bitcast=True)
    r = rint(tl.math.div_rn(x, quantum)) * quantum  # exactly an e4m3 value (a carry may raise its exponent)
    rbits = tl.abs(r).to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1  # x's sign: a negative x that rounds to zero is -0 (0x80), as torch gives
    rexp = ((rbits >> 23) & 0xFF) - 127
    normal = ((rexp + 7) << 3) | ((rbits >> 20) & 7)
    subnormal = (tl.abs(r) * 512.0).to(tl.int32)  # r / 2^-9, exact
    return ((sign << 7) | tl.where(rexp >= -6, normal, subnormal)).to(tl.uint8)
