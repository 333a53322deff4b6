"""Received KV of any codec landed in a quantised (int8/fp8) cache layer by block index, in one kernel.

The decode cache stores a quantised layer as codes with one float32 scale per (token, head)
(``QuantizedLayerStorage``). A chunk that arrives in a codec the layer does not store natively (int4,
bf16 or fp32 into an int8/fp8 layer; int8 into fp8 and fp8 into int8) is read from its received payload
(+ scales, int4's zero points), dequantised in registers exactly as the codec's float32 decode computes
it, and quantised per (token, head) exactly as the cache's own write does (``kv_write``: s = max(|x|, floored
at 1e-12) / qmax, q = x / s, both IEEE divisions; int8 rounds half to even and clamps to +-127, fp8 takes
the e4m3 cast), codes and scales stored straight into cache blocks ``ids`` (a device tensor). No float
copy of the chunk is made. The result is bit for bit what decoding to float32 and ``storage.write`` give
on CPU (the torch path in ``workers.decode.kv_sink``, which the tests hold it to).

Refusal: a chunk whose decoded values hold NaN or inf is refused with ``CodecError`` and changes nothing.
Why two launches of the one kernel: a program sees only its own (block, head), so whether any of the
chunk is non-finite is known only once every program has read its part. The first launch (CHECK) reads
and dequantises, writes nothing and raises a device flag; the second (WRITE) reads the flag and stores
only when it is clear. The payload is read twice, the cache written once, and the host waits once, for
the flag, after both launches.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvtransfer.codecs import Codec, CodecError, EncodedTensor, Kind
from kvtransfer.codecs.encoded import non_finite_landing
from kvtransfer.codecs.int4 import key_group, value_group
from kvtransfer.codecs.triton_common import abs_bits_max, from_e4m3
from kvtransfer.staging import on_device
from workers.runtime.kernels.cache_views import DENSE, cache_tensors
from workers.runtime.kernels.fused import EXACT
from workers.runtime.kernels.kv_write import quantize_codes
from workers.runtime.kv_cache import QuantizedLayerStorage

__all__ = ["CODECS", "land_requantised"]

# The received codecs this kernel reads, as its CODEC constexpr.
CODECS = {"int8": 0, "fp8": 1, "int4": 2, "bf16": 3, "fp32": 4}


@triton.jit
def _decoded(payload, scales, zeros, i, h, t, c, mask, bs, H, D, G, CODEC: tl.constexpr, IS_KEY: tl.constexpr):
    """float32 values at tokens ``t`` [BT, 1] and channels ``c`` [1, BD] of (block i, head h) of the
    received tensor, as the codec's decode computes them; masked lanes are 0."""
    row = (i * bs + t) * H + h
    if CODEC == 0:  # int8: code * the (block, head) scale
        x = tl.load(payload + row * D + c, mask=mask, other=0).to(tl.float32) * tl.load(scales + i * H + h)
    elif CODEC == 1:  # fp8: the e4m3 value (NaN for its NaN codes) * the block's scale
        code = tl.load(payload + row * D + c, mask=mask, other=0).to(tl.int32) & 0xFF
        x = from_e4m3(code) * tl.load(scales + i)
    elif CODEC == 2:  # int4: nibble * scale, then + zero (two roundings: fp-fusion is off), float16 groups
        packed = tl.load(payload + row * (D // 2) + c // 2, mask=mask, other=0).to(tl.int32)
        q = ((packed >> ((c % 2) * 4)) & 15).to(tl.float32)
        if IS_KEY:
            g = ((i * (bs // G) + t // G) * H + h) * D + c
        else:
            g = row * (D // G) + c // G
        x = q * tl.load(scales + g, mask=mask, other=0).to(tl.float32)
        x = x + tl.load(zeros + g, mask=mask, other=0).to(tl.float32)
    elif CODEC == 3:  # bf16 bits widened, exact
        b = tl.load(payload + row * D + c, mask=mask, other=0).to(tl.int32) & 0xFFFF
        x = (b << 16).to(tl.float32, bitcast=True)
    else:  # fp32 bits as they are
        x = tl.load(payload + row * D + c, mask=mask, other=0.0)
    return tl.where(mask, x, 0.0)  # a non-finite scale must not leak into masked lanes


@triton.jit
def requant_kernel(payload, scales, zeros, codes, cscales, flag, ids, bs, H, D, G, stride_cs, stride_ch, stride_ss,
                   qmax, CODEC: tl.constexpr, IS_KEY: tl.constexpr, KIND: tl.constexpr, WRITE: tl.constexpr,
                   BT: tl.constexpr, BD: tl.constexpr):
    """One program per (received block i, head h), BT tokens at a time. CHECK (WRITE false): raise
    ``flag`` if any decoded value is NaN or inf. WRITE: unless ``flag`` is set, store each token's codes
    and scale at slot ids[i] * bs + t of the cache (``codes`` [slots, heads, head_dim], fp8 as uint8;
    ``cscales`` [slots, heads])."""
    i = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    blk = tl.load(ids + i).to(tl.int64)
    c = tl.arange(0, BD)[None, :]
    cmask = c < D
    refused = tl.load(flag) if WRITE else 0
    worst = tl.full([], 0, tl.int32)
    for t0 in range(0, bs, BT):
        t1 = t0 + tl.arange(0, BT)
        tmask = t1 < bs
        t = t1[:, None]
        mask = tmask[:, None] & cmask
        x = _decoded(payload, scales, zeros, i, h, t, c, mask, bs, H, D, G, CODEC, IS_KEY)
        if WRITE:
            # a refused chunk stores nothing: keep its NaN/inf out of the arithmetic (no NaN is cast)
            x = tl.where((x.to(tl.int32, bitcast=True) & 0x7FFFFFFF) < 0x7F800000, x, 0.0)
            # the cache's own quantised write (kv_write._write_one), per token over head_dim
            amax = tl.max(tl.abs(x), 1)
            scale = tl.math.div_rn(tl.maximum(amax, 1e-12), qmax)
            slot = blk * bs + t1
            ok = tmask & ((t1 * 0 + refused) == 0)  # a tensor: the interpreter takes no scalar in a mask
            tl.store(codes + slot[:, None] * stride_cs + h * stride_ch + c,
                     quantize_codes(x, scale[:, None], qmax, KIND), mask=ok[:, None] & cmask)
            tl.store(cscales + slot * stride_ss + h, scale, mask=ok)
        else:
            worst = tl.maximum(worst, abs_bits_max(x))
    if not WRITE:
        tl.atomic_max(flag, 1, mask=worst >= 0x7F800000)


def land_requantised(codec: Codec, key: EncodedTensor, value: EncodedTensor, storage: QuantizedLayerStorage,
                     block_size: int, ids: torch.Tensor) -> None:
    """Land ``key`` and ``value`` (``codec``'s, parts on the cache's device, shape [n, block_size, heads,
    head_dim]) in cache blocks ``ids`` (1-D long, n valid block ids, the cache's device) of ``storage``.

    Raises CodecError, writing nothing, when a part does not fit the codec and shape, the shape or ids do
    not fit the cache, or the decoded values hold NaN or inf (this waits for the kernels)."""
    if codec.name not in CODECS:
        raise CodecError(f"no requantising kernel reads codec {codec.name!r} (it reads {', '.join(CODECS)})")
    cache = cache_tensors(storage)
    if cache.kind == DENSE or cache.k_scale is None or cache.v_scale is None:
        raise CodecError("land_requantised writes a quantised (int8/fp8) layer")
    dev = cache.k.device
    slots, heads, head_dim = cache.k.shape
    shape = (ids.numel(), block_size, heads, head_dim)
    if ids.dtype != torch.long or ids.dim() != 1 or ids.device != dev:
        raise CodecError(f"block ids must be a 1-D long tensor on the cache's device {dev}, got {ids.dtype} "
                         f"{tuple(ids.shape)} on {ids.device}")
    if slots % block_size or cache.k.stride(2) != 1 or cache.k_scale.stride(1) != 1:
        raise CodecError(f"cache of {slots} slots, strides {cache.k.stride()}, is not blocks of {block_size} "
                         f"tokens with unit stride on head_dim")
    for enc, want in ((key, Kind.KEY), (value, Kind.VALUE)):
        codec.check(enc)
        if enc.kind is not want or enc.shape != shape:
            raise CodecError(f"received {enc.kind.name} of shape {enc.shape}, expected {want.name} of {shape}")
        for part in (enc.payload, enc.scales, enc.zeros):
            if part is not None and part.device != dev:
                raise CodecError(f"received parts must be on the cache's device {dev}, got {part.device}")
    n, bs, h, d = shape
    bd = triton.next_power_of_2(d)
    bt = max(1, min(triton.next_power_of_2(bs), 4096 // bd))  # a tile of about 4096 elements
    flag = torch.zeros(1, dtype=torch.int32, device=dev)
    launches = ((key, cache.k, cache.k_scale), (value, cache.v, cache.v_scale))
    with on_device(dev):  # Triton launches on the current device, whichever thread lands
        for write in (False, True):
            for enc, codes, cscales in launches:
                is_key = enc.kind is Kind.KEY
                group = (key_group(bs) if is_key else value_group(d)) if codec.name == "int4" else 1
                requant_kernel[(n, h)](
                    _payload_view(codec.name, enc.payload), enc.scales,
                    enc.scales if enc.zeros is None else enc.zeros, codes, cscales, flag, ids, bs, h, d, group,
                    codes.stride(0), codes.stride(1), cscales.stride(0), cache.qmax, CODEC=CODECS[codec.name],
                    IS_KEY=is_key, KIND=cache.kind, WRITE=write, BT=bt, BD=bd, **EXACT)
    if bool(flag[0]):
        raise non_finite_landing(codec.name, storage.dtype_name)


def _payload_view(name: str, payload: torch.Tensor) -> torch.Tensor:
    """The payload as the kernel reads it: int8 codes signed, bf16 as int16 bits, fp32 as float32."""
    if name == "int8":
        return payload.view(torch.int8)
    if name == "bf16":
        return payload.view(torch.int16)
    if name == "fp32":
        return payload.view(torch.float32)
    return payload
