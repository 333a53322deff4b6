"""fp32: float32 values byte for byte. Lossless against a float32 cache (and exact for bf16 input).

It exists so that a float32 engine (the default on CPU) can move its cache with no rounding at all,
which is what an exact oracle test needs; it costs twice the bytes of bf16.
Payload: the float32 values, 4 bytes each, in [n_blocks, block_size, kv_heads, head_dim] order.
"""

from __future__ import annotations

import torch

from kvtransfer.codecs.base import Codec, Shape, raise_non_finite
from kvtransfer.codecs.encoded import CodecId, EncodedTensor, Kind, WireLayout


class Fp32Codec(Codec):
    name = "fp32"
    codec_id = CodecId.FP32

    def _layout(self, shape: Shape, kind: Kind) -> WireLayout:
        n, b, h, d = shape
        return WireLayout(payload_nbytes=n * b * h * d * 4, scales_shape=(0,), scales_dtype=torch.float32)

    def _encode(self, x: torch.Tensor, kind: Kind, layout: WireLayout) -> EncodedTensor:
        y = x if x.dtype == torch.float32 else x.to(torch.float32)
        lo, hi = torch.aminmax(y)
        if not (torch.isfinite(lo) and torch.isfinite(hi)):
            raise_non_finite(self.name)
        return EncodedTensor(self.codec_id, kind, _shape4(x), y.reshape(-1).view(torch.uint8),
                             torch.empty(0, device=x.device))

    def _decode_into(self, enc: EncodedTensor, out: torch.Tensor) -> None:
        out.copy_(enc.payload.view(torch.float32).view(enc.shape))

    def _error_bound(self, xf: torch.Tensor, kind: Kind) -> torch.Tensor:
        return torch.zeros((), dtype=torch.float32)


__all__ = ["Fp32Codec"]


def _shape4(x: torch.Tensor) -> tuple[int, int, int, int]:
    n, b, h, d = x.shape  # checked 4-D by Codec.encode
    return (n, b, h, d)
