"""Triton kernels of the int4 codec (kvtransfer.codecs.int4), reading and writing cache blocks by index.

Keys: one program per (block, token group, head) quantises each channel over the group's tokens;
values: one program per (block, tile of tokens, head) quantises each token's groups of channels. Even and odd
channels are handled as two halves, so each byte (even channel low nibble) is written once.
``flags`` gets one int32 per program: 1 NaN/inf, 2 a minimum beyond float16, 4 a range / 15 beyond
float16; the caller refuses the tensor with the torch codec's message. The source is a float cache, or
(SRC 1/2) a quantised one's codes and scales, read as ``triton_common._load_src`` does.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtransfer.codecs.triton_common import _f16_value, _load_src, _rne, _round_down_f16, _round_up_f16, _store_out

F16_MAX = tl.constexpr(65504.0)
INF = tl.constexpr(float("inf"))


@triton.jit
def _bad(xe, xo):
    """True when either half holds NaN or inf (masked lanes were loaded as 0)."""
    m = tl.maximum(tl.max(xe.to(tl.int32, bitcast=True) & 0x7FFFFFFF),
                   tl.max(xo.to(tl.int32, bitcast=True) & 0x7FFFFFFF))
    return m >= 0x7F800000


@triton.jit
def _quant_pair(bad, lo, hi, mask):
    """Zero and scale float16 bits of groups with min ``lo`` and max ``hi``, and the program's flags."""
    # NaN (refused by ``bad``) would only warn further on; a zero minimum is +0 whatever the sign of the
    # zeros it came from, as the torch codec stores it (which zero min() returns is the implementation's)
    lo_ok = tl.where((lo == lo) & (lo != 0.0), lo, 0.0)
    zb = _round_down_f16(lo_ok)
    s = tl.math.div_rn(tl.where(hi == hi, hi, 0.0) - _f16_value(zb), 15.0)
    sb = _round_up_f16(s)
    sb = tl.where(_f16_value(sb) < 5.960464477539063e-08, 0x0001, sb)  # clamp_min(2**-24)
    flags = tl.where(bad, 1, 0)
    flags = flags | tl.where(tl.max(tl.where(mask, tl.abs(lo_ok), 0.0)) > F16_MAX, 2, 0)
    flags = flags | tl.where(tl.max(tl.where(mask, sb & 0x7FFF, 0)) >= 0x7C00, 4, 0)
    return zb, sb, flags


@triton.jit
def _codes(x, zero, inv):
    # refused groups (NaN/inf, out of float16's range) are quantised with harmless values: no NaN is cast
    x = tl.where((x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000, x, 0.0)
    zero = tl.where(tl.abs(zero) <= F16_MAX, zero, 0.0)
    inv = tl.where(tl.abs(inv) < INF, inv, 0.0)
    q = _rne((x - zero) * inv)
    return tl.minimum(tl.maximum(q, 0.0), 15.0).to(tl.int32)


@triton.jit
def int4_key_encode_kernel(src, sscale, ids, payload, scales, zeros, flags, bs, H, D, G, sb, st, sh, sd, ssb, sst,
                           ssh, BG: tl.constexpr, BJ: tl.constexpr, SRC: tl.constexpr, ROUND_BF16: tl.constexpr):
    i = tl.program_id(0)
    g = tl.program_id(1)
    h = tl.program_id(2)
    ng = bs // G
    blk = tl.load(ids + i).to(tl.int64)
    t = g * G + tl.arange(0, BG)[:, None]
    j = tl.arange(0, BJ)[None, :]
    mask = (tl.arange(0, BG)[:, None] < G) & (j < D // 2)
    base = blk * sb + h * sh + t * st
    soff = blk * ssb + h * ssh + t * sst
    xe = _load_src(src, sscale, base + (2 * j) * sd, soff, mask, SRC, ROUND_BF16)
    xo = _load_src(src, sscale, base + (2 * j + 1) * sd, soff, mask, SRC, ROUND_BF16)
    lo_e, hi_e = tl.min(tl.where(mask, xe, INF), axis=0), tl.max(tl.where(mask, xe, -INF), axis=0)
    lo_o, hi_o = tl.min(tl.where(mask, xo, INF), axis=0), tl.max(tl.where(mask, xo, -INF), axis=0)
    cmask = tl.arange(0, BJ) < D // 2
    bad = _bad(xe, xo)
    ze, se, fe = _quant_pair(bad, lo_e, hi_e, cmask)
    zo, so, fo = _quant_pair(bad, lo_o, hi_o, cmask)
    tl.store(flags + (i * ng + g) * H + h, fe | fo)
    srow = ((i * ng + g) * H + h) * D + 2 * tl.arange(0, BJ)
    tl.store(scales + srow, se.to(tl.int16), mask=cmask)
    tl.store(scales + srow + 1, so.to(tl.int16), mask=cmask)
    tl.store(zeros + srow, ze.to(tl.int16), mask=cmask)
    tl.store(zeros + srow + 1, zo.to(tl.int16), mask=cmask)
    inv_e = tl.math.div_rn(1.0, _f16_value(se))[None, :]
    inv_o = tl.math.div_rn(1.0, _f16_value(so))[None, :]
    qe = _codes(xe, _f16_value(ze)[None, :], inv_e)
    qo = _codes(xo, _f16_value(zo)[None, :], inv_o)
    out = payload + ((i * bs + t) * H + h) * (D // 2) + j
    tl.store(out, (qe | (qo << 4)).to(tl.uint8), mask=mask)


@triton.jit
def int4_value_encode_kernel(src, sscale, ids, payload, scales, zeros, flags, bs, H, D, G, sb, st, sh, sd, ssb, sst,
                             ssh, BT: tl.constexpr, BN: tl.constexpr, BH: tl.constexpr, SRC: tl.constexpr,
                             ROUND_BF16: tl.constexpr):
    """One program per (block, tile of BT tokens, head): a [tokens, groups, half-group] tile."""
    i = tl.program_id(0)
    tt = tl.program_id(1)
    h = tl.program_id(2)
    ng = D // G
    blk = tl.load(ids + i).to(tl.int64)
    t = tt * BT + tl.arange(0, BT)[:, None, None]
    g = tl.arange(0, BN)[None, :, None]
    j = tl.arange(0, BH)[None, None, :]
    mask = (t < bs) & (g < ng) & (j < G // 2)
    ch = g * G + 2 * j
    base = blk * sb + t * st + h * sh
    soff = blk * ssb + t * sst + h * ssh
    xe = _load_src(src, sscale, base + ch * sd, soff, mask, SRC, ROUND_BF16)
    xo = _load_src(src, sscale, base + (ch + 1) * sd, soff, mask, SRC, ROUND_BF16)
    lo = tl.minimum(tl.min(tl.where(mask, xe, INF), axis=2), tl.min(tl.where(mask, xo, INF), axis=2))
    hi = tl.maximum(tl.max(tl.where(mask, xe, -INF), axis=2), tl.max(tl.where(mask, xo, -INF), axis=2))
    t2 = tt * BT + tl.arange(0, BT)[:, None]
    g2 = tl.arange(0, BN)[None, :]
    gmask = (t2 < bs) & (g2 < ng)
    zb, sbits, f = _quant_pair(_bad(xe, xo), lo, hi, gmask)
    tl.store(flags + (i * tl.num_programs(1) + tt) * H + h, f)
    srow = ((i * bs + t2) * H + h) * ng + g2
    tl.store(scales + srow, sbits.to(tl.int16), mask=gmask)
    tl.store(zeros + srow, zb.to(tl.int16), mask=gmask)
    inv = tl.math.div_rn(1.0, _f16_value(sbits))[:, :, None]
    zero = _f16_value(zb)[:, :, None]
    qe = _codes(xe, zero, inv)
    qo = _codes(xo, zero, inv)
    out = payload + ((i * bs + t) * H + h) * (D // 2) + ch // 2
    tl.store(out, (qe | (qo << 4)).to(tl.uint8), mask=mask)


@triton.jit
def int4_decode_kernel(payload, scales, zeros, dst, ids, bs, H, D, G, IS_KEY: tl.constexpr,
                       sb, st, sh, sd, BT: tl.constexpr, BJ: tl.constexpr, OUT_BF16: tl.constexpr):
    """One program per (block, head): BT tokens at a time, each row's D/2 bytes to D channels."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(ids + i).to(tl.int64)
    j = tl.arange(0, BJ)[None, :]
    for t0 in range(0, bs, BT):
        t = t0 + tl.arange(0, BT)[:, None]
        mask = (t < bs) & (j < D // 2)
        packed = tl.load(payload + ((i * bs + t) * H + h) * (D // 2) + j, mask=mask, other=0).to(tl.int32)
        qe = (packed & 15).to(tl.float32)
        qo = ((packed >> 4) & 15).to(tl.float32)
        if IS_KEY:
            ie = ((i * (bs // G) + t // G) * H + h) * D + 2 * j
            io = ie + 1
        else:
            srow = ((i * bs + t) * H + h) * (D // G)
            ie = srow + (2 * j) // G
            io = srow + (2 * j + 1) // G
        se = tl.load(scales + ie, mask=mask, other=0).to(tl.float32)
        so = tl.load(scales + io, mask=mask, other=0).to(tl.float32)
        ze = tl.load(zeros + ie, mask=mask, other=0).to(tl.float32)
        zo = tl.load(zeros + io, mask=mask, other=0).to(tl.float32)
        base = dst + blk * sb + t * st + h * sh
        ye = qe * se  # multiply, then add: two roundings, as the torch codec (fp-fusion is off)
        yo = qo * so
        _store_out(base + (2 * j) * sd, ye + ze, mask, OUT_BF16)
        _store_out(base + (2 * j + 1) * sd, yo + zo, mask, OUT_BF16)
