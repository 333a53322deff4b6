"""Triton kernels of the bf16 codec: cache blocks by index to bf16 payload and back, one program per
block, a tile of tokens at a time. Encode rounds float32 to nearest even (torch's cast, on the bits) or copies bf16
bits as they are, and flags a row whose bf16 value is NaN or inf (float32 overflow included), as the
torch codec refuses it after its cast. bf16 tensors are passed viewed as int16. With SRC 1/2 the source is
a quantised cache's codes and scales, read as ``triton_common._load_src`` does, then rounded as float32 is."""

from __future__ import annotations

import triton
import triton.language as tl

from kvtransfer.codecs.triton_common import _bf16_bits, _load_src


@triton.jit
def bf16_encode_kernel(src, sscale, ids, payload, flags, bs, H, D, sb, st, sh, sd, ssb, sst, ssh, BT: tl.constexpr,
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
            bits = _bf16_bits(_load_src(src, sscale, blk * sb + t * st + off_e, blk * ssb + t * sst + soff_e, mask,
                                        SRC, ROUND_BF16))
        elif IN_BF16:
            bits = tl.load(src + blk * sb + t * st + off_e, mask=mask, other=0).to(tl.int32) & 0xFFFF
        else:
            bits = _bf16_bits(tl.load(src + blk * sb + t * st + off_e, mask=mask, other=0))
        m = tl.maximum(m, tl.max(bits & 0x7FFF))
        tl.store(payload + (i * bs + t) * (H * D) + e, bits.to(tl.int16), mask=mask)
    tl.store(flags + i, tl.where(m >= 0x7F80, 1, 0))


@triton.jit
def bf16_decode_kernel(payload, dst, ids, bs, H, D, sb, st, sh, sd, BT: tl.constexpr, BE: tl.constexpr,
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
            tl.store(out, b, mask=mask)
        else:
            tl.store(out, ((b.to(tl.int32) & 0xFFFF) << 16).to(tl.float32, bitcast=True), mask=mask)
