"""Triton kernels of the int8 and fp8 codecs, reading and writing the paged cache by block index.

Encode reads blocks ``ids[i]`` of a cache tensor [num_blocks, block_size, heads, head_dim] (float32
or bf16, any strides; or, with SRC 1/2, a quantised cache's codes and per-(token, head) scales, read
as ``triton_common._load_src`` does) and writes block i of the payload and its scale(s), in one launch:
one program per (block, head) for int8, per block for fp8. Decode writes payload block i straight into
cache block ``ids[i]``. The arithmetic is the torch codecs' (see triton_common), so the bytes are
identical; a non-finite input shows as a non-finite scale, which the caller refuses.
"""

from __future__ import annotations

import triton
import triton.language as tl

from kvtransfer.codecs.triton_common import TINY, _load_src, _rne, _store_out, _to_e4m3, abs_bits_max, from_e4m3


@triton.jit
def int8_encode_kernel(src, sscale, ids, payload, scales, bs, H, D, sb, st, sh, sd, ssb, sst, ssh,
                       BT: tl.constexpr, BD: tl.constexpr, SRC: tl.constexpr, ROUND_BF16: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(ids + i).to(tl.int64)
    t = tl.arange(0, BT)[:, None]
    d = tl.arange(0, BD)[None, :]
    base = blk * sb + h * sh
    sbase = blk * ssb + h * ssh
    m = tl.full([], 0, tl.int32)
    for t0 in range(0, bs, BT):
        mask = ((t0 + t) < bs) & (d < D)
        x = _load_src(src, sscale, base + (t0 + t) * st + d * sd, sbase + (t0 + t) * sst, mask, SRC, ROUND_BF16)
        m = tl.maximum(m, abs_bits_max(x))
    amax = m.to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, 127.0)
    scale = tl.where(scale < TINY, TINY, scale)
    tl.store(scales + i * H + h, scale)
    # a non-finite block is refused by its scale; quantise it with 1 so no NaN is cast
    inv = tl.math.div_rn(1.0, tl.where(m >= 0x7F800000, 1.0, scale))
    out = payload + (i * bs * H + h) * D
    for t0 in range(0, bs, BT):
        mask = ((t0 + t) < bs) & (d < D)
        x = _load_src(src, sscale, base + (t0 + t) * st + d * sd, sbase + (t0 + t) * sst, mask, SRC, ROUND_BF16)
        x = tl.where((x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000, x, 0.0)
        q = _rne(x * inv).to(tl.int32)
        tl.store(out + (t0 + t) * (H * D) + d, q.to(tl.int8), mask=mask)


@triton.jit
def int8_decode_kernel(payload, scales, dst, ids, bs, H, D, sb, st, sh, sd,
                       BT: tl.constexpr, BD: tl.constexpr, OUT_BF16: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    blk = tl.load(ids + i).to(tl.int64)
    t = tl.arange(0, BT)[:, None]
    d = tl.arange(0, BD)[None, :]
    s = tl.load(scales + i * H + h)
    src = payload + (i * bs * H + h) * D
    base = dst + blk * sb + h * sh
    for t0 in range(0, bs, BT):
        mask = ((t0 + t) < bs) & (d < D)
        q = tl.load(src + (t0 + t) * (H * D) + d, mask=mask, other=0).to(tl.float32)
        y = q * s
        _store_out(base + (t0 + t) * st + d * sd, y, mask, OUT_BF16)


@triton.jit
def fp8_encode_kernel(src, sscale, ids, payload, scales, bs, H, D, sb, st, sh, sd, ssb, sst, ssh,
                      BT: tl.constexpr, BE: tl.constexpr, SRC: tl.constexpr, ROUND_BF16: tl.constexpr):
    i = tl.program_id(0)
    blk = tl.load(ids + i).to(tl.int64)
    t = tl.arange(0, BT)[:, None]
    e = tl.arange(0, BE)[None, :]  # (head, dim) flattened
    off_e = (e // D) * sh + (e % D) * sd
    soff_e = (e // D) * ssh
    base = blk * sb
    sbase = blk * ssb
    m = tl.full([], 0, tl.int32)
    for t0 in range(0, bs, BT):
        mask = ((t0 + t) < bs) & (e < H * D)
        x = _load_src(src, sscale, base + (t0 + t) * st + off_e, sbase + (t0 + t) * sst + soff_e, mask, SRC,
                      ROUND_BF16)
        m = tl.maximum(m, abs_bits_max(x))
    amax = m.to(tl.float32, bitcast=True)
    scale = tl.math.div_rn(amax, 448.0)
    scale = tl.where(scale < TINY, TINY, scale)
    tl.store(scales + i, scale)
    inv = tl.math.div_rn(1.0, tl.where(m >= 0x7F800000, 1.0, scale))
    out = payload + i * bs * H * D
    for t0 in range(0, bs, BT):
        mask = ((t0 + t) < bs) & (e < H * D)
        x = _load_src(src, sscale, base + (t0 + t) * st + off_e, sbase + (t0 + t) * sst + soff_e, mask, SRC,
                      ROUND_BF16)
        x = tl.where((x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000, x, 0.0)
        y = tl.minimum(tl.maximum(x * inv, -448.0), 448.0)
        tl.store(out + (t0 + t) * (H * D) + e, _to_e4m3(y).to(tl.uint8), mask=mask)


@triton.jit
def fp8_decode_kernel(payload, scales, dst, ids, bs, H, D, sb, st, sh, sd,
                      BT: tl.constexpr, BE: tl.constexpr, OUT_BF16: tl.constexpr):
    i = tl.program_id(0)
    blk = tl.load(ids + i).to(tl.int64)
    t = tl.arange(0, BT)[:, None]
    e = tl.arange(0, BE)[None, :]
    off_e = (e // D) * sh + (e % D) * sd
    s = tl.load(scales + i)
    src = payload + i * bs * H * D
    base = dst + blk * sb
    for t0 in range(0, bs, BT):
        mask = ((t0 + t) < bs) & (e < H * D)
        c = tl.load(src + (t0 + t) * (H * D) + e, mask=mask, other=0).to(tl.int32)
        y = from_e4m3(c) * s
        _store_out(base + (t0 + t) * st + off_e, y, mask, OUT_BF16)
