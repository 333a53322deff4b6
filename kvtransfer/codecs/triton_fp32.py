"""Triton kernels of the fp32 codec: cache blocks by index to float32 payload and back, one program per
block, a tile of tokens at a time.

Encode copies each value's float32 bits (bf16 bits widened, which is exact) into payload block i and flags
the block if any value is NaN or inf, as the torch codec refuses it: one read of the cache, one write of the
payload. Why a kernel and not ``index_select(..., out=payload)``: that gathers in one pass too, but the
finite check would then read the payload again (and a bf16 cache needs a cast pass as well); here the
check rides on the copy. Decode writes payload block i straight into cache block ``ids[i]``: the bits into
a float32 cache, rounded to nearest even into a bf16 one (torch's cast). float32 tensors are passed viewed
as int32, bf16 ones as int16, so the bits move untouched. With SRC 1/2 the source is a quantised cache's codes
and scales, read as ``triton_common._load_src`` does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtransfer.codecs.triton_common import _bf16_bits, _load_src


@triton.jit
def fp32_encode_kernel(src, sscale, ids, payload, flags, bs, H, D, sb, st, sh, sd, ssb, sst, ssh, BT: tl.constexpr,
                       BE: tl.constexpr, IN_BF16: tl.constexpr, SRC: tl.constexpr, ROUND_BF16: tl.constexpr):
    i = tl.program_id(0)
    blk = tl.load(ids + i).to(tl.int64)
    e = tl.arange(0, BE)[None, :]
    off_e = (e // D) * sh + (e % D) * sd
    soff_e = (e // D) * ssh
    m = tl.full([], 0, tl.int32)
    for t0 in range(0, bs, BT):
        t = t0 + tl.arange(0, BT)[:, None]
        mask = (t < bs) & (e < H * D)
        if SRC != 0:
            x = _load_src(src, sscale, blk * sb + t * st + off_e, blk * ssb + t * sst + soff_e, mask, SRC, ROUND_BF16)
            bits = x.to(tl.int32, bitcast=True)
        elif IN_BF16:
            bits = (tl.load(src + blk * sb + t * st + off_e, mask=mask, other=0).to(tl.int32) & 0xFFFF) << 16
        else:
            bits = tl.load(src + blk * sb + t * st + off_e, mask=mask, other=0)
        m = tl.maximum(m, tl.max(bits & 0x7FFFFFFF))
        tl.store(payload + (i * bs + t) * (H * D) + e, bits, mask=mask)
    tl.store(flags + i, tl.where(m >= 0x7F800000, 1, 0))


@triton.jit
def fp32_decode_kernel(payload, dst, ids, bs, H, D, sb, st, sh, sd, BT: tl.constexpr, BE: tl.constexpr,
                       OUT_BF16: tl.constexpr):
    i = tl.program_id(0)
    blk = tl.load(ids + i).to(tl.int64)
    e = tl.arange(0, BE)[None, :]
    off_e = (e // D) * sh + (e % D) * sd
    for t0 in range(0, bs, BT):
        t = t0 + tl.arange(0, BT)[:, None]
        mask = (t < bs) & (e < H * D)
        b = tl.load(payload + (i * bs + t) * (H * D) + e, mask=mask, other=0)
        out = dst + blk * sb + t * st + off_e
        if OUT_BF16:
            tl.store(out, _bf16_bits(b.to(tl.float32, bitcast=True)).to(tl.int16), mask=mask)
        else:
            tl.store(out, b, mask=mask)
