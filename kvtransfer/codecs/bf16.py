"""bf16: the cache's own bytes. Lossless against a bf16 cache.

Payload: the bf16 values, 2 bytes each, in [n_blocks, block_size, kv_heads, head_dim] order.
No scales. Bound: 0 for values bf16 holds exactly (all of a bf16 input); otherwise
round-to-nearest to bf16, |err| <= 2^-8 * |x| (plus the float32 underflow floor).
"""

from __future__ import annotations

import numpy as np
import torch

from kvtransfer.codecs import native
from kvtransfer.codecs.base import FLOAT32_TINY, Codec, Shape, raise_non_finite
from kvtransfer.codecs.encoded import CodecId, EncodedTensor, Kind, WireLayout

_UNIT_ROUNDOFF = 2.0**-8
_PIECE = 1 << 19  # elements (1 MiB of bf16) per copy-then-check step: stays in a core's L2


def all_finite_bf16(y: torch.Tensor) -> bool:
    """True unless a bf16 tensor holds NaN or inf, from integer max reductions.

    A bf16 value is non-finite exactly when its 8 exponent bits are all ones. With the native kernels
    (kvtransfer.codecs.native): one pass, the max of ``v & 0x7FFF`` below 0x7F80. Without: numpy, read
    as int16 a value >= 0x7F80 (sign bit clear), read as uint16 a value >= 0xFF80 (sign bit set); finite
    values of either sign stay below both. Both are checked over all 65536 patterns. Why integers: an
    integer max reads the bits as they are, where a float aminmax over bf16 converts every element first."""
    if y.numel() == 0:
        return True
    if y.device.type != "cpu":
        lo, hi = torch.aminmax(y)
        return bool(torch.isfinite(lo) and torch.isfinite(hi))
    flat = y.detach().reshape(-1)
    lib = native.load()
    if lib is not None:  # ctypes releases the GIL for the call
        flat = flat.contiguous()  # the kernel reads n values back to back
        return bool(lib.kv_bf16_all_finite(flat.data_ptr(), flat.numel()))
    bits = flat.view(torch.int16).numpy()  # numpy: no torch threads, GIL released
    return int(bits.max()) < 0x7F80 and int(bits.view(np.uint16).max()) < 0xFF80


class Bf16Codec(Codec):
    name = "bf16"
    codec_id = CodecId.BF16
    decodes_to_bf16 = True

    def _layout(self, shape: Shape, kind: Kind) -> WireLayout:
        n, b, h, d = shape
        return WireLayout(payload_nbytes=n * b * h * d * 2, scales_shape=(0,), scales_dtype=torch.float32)

    def _encode(self, x: torch.Tensor, kind: Kind, layout: WireLayout) -> EncodedTensor:
        # bf16 input: zero copy, the payload aliases x. float32: one rounding cast.
        y = x if x.dtype == torch.bfloat16 else x.to(torch.bfloat16)
        if not all_finite_bf16(y):  # after the cast: catches float32 overflow too
            raise_non_finite(self.name)
        payload = y.view(-1).view(torch.uint8)
        return EncodedTensor(self.codec_id, kind, _shape4(x), payload, torch.empty(0, device=x.device))

    def _encode_into(self, x: torch.Tensor, kind: Kind, layout: WireLayout, payload: torch.Tensor) -> EncodedTensor:
        # Copy (a float32 input: the rounding cast), then check what was written while it is still
        # in cache: the input is read once from memory instead of twice.
        dest, src = payload.view(torch.bfloat16), x.reshape(-1)
        for i in range(0, dest.numel(), _PIECE):
            piece = dest[i:i + _PIECE]
            piece.copy_(src[i:i + _PIECE])
            if not all_finite_bf16(piece):
                raise_non_finite(self.name)
        return EncodedTensor(self.codec_id, kind, _shape4(x), payload, torch.empty(0, device=x.device))

    def _decode_into(self, enc: EncodedTensor, out: torch.Tensor) -> None:
        out.copy_(enc.payload.view(torch.bfloat16).view(enc.shape))

    def _error_bound(self, xf: torch.Tensor, kind: Kind) -> torch.Tensor:
        exact = xf.to(torch.bfloat16).to(torch.float32) == xf
        return torch.where(exact, 0.0, xf.abs().mul_(_UNIT_ROUNDOFF).add_(FLOAT32_TINY))


__all__ = ["Bf16Codec", "all_finite_bf16"]


def _shape4(x: torch.Tensor) -> tuple[int, int, int, int]:
    n, b, h, d = x.shape  # checked 4-D by Codec.encode
    return (n, b, h, d)
