"""Triton kernel of ``device_checksum``: one read of the bytes, one partial sum per program.

Each program takes ``BLOCK`` consecutive 32-bit little-endian words, multiplies each word ``w_i`` by its
odd factor ``2 * (i * 0x9E3779B1 mod 2**32) + 1`` and sums the products modulo 2**64 (unsigned 64-bit
arithmetic wraps), storing the sum's bits as an int64. Integer sums are exact in any order, so the
partials' sum modulo 2**64 equals the torch reference's whatever the block size or the GPU."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def checksum_kernel(words, partial, n_words, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    idx = pid.to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    w = tl.load(words + idx, mask=idx < n_words, other=0)
    w64 = w.to(tl.uint32, bitcast=True).to(tl.uint64)
    x = (idx.to(tl.uint32) * 0x9E3779B1).to(tl.uint64)
    # w * (2x + 1) as 2 * (w * x) + w: a product of two 32-bit values, one widening multiply on the GPU
    tl.store(partial + pid, tl.sum((w64 * x) * 2 + w64, axis=0).to(tl.int64, bitcast=True))
