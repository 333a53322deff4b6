"""bf16: the cache's own bytes. Lossless against a bf16 cache.

Payload: the bf16 values, 2 bytes each, in [n_blocks, block_size, kv_heads, head_dim] order.
No scales. Bound: 0 for values bf16 holds exactly (all of a bf16 input); otherwise
round-to-nearest to bf16, |err| <= 2^-8 * |x| (plus the float32 underflow floor).
"""

from __future__ import annotations

import torch

from kvtransfer.codecs.base import FLOAT32_TINY, Codec, Shape, raise_non_finite
from kvtransfer.codecs.encoded import CodecId, EncodedTensor, Kind, WireLayout

_UNIT_ROUNDOFF = 2.0**-8


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
        lo, hi = torch.aminmax(y)  # one pass, no temporary; NaN propagates, inf shows as an extreme
        if not (torch.isfinite(lo) and torch.isfinite(hi)):  # after the cast: catches float32 overflow too
            raise_non_finite(self.name)
        payload = y.view(-1).view(torch.uint8)
        return EncodedTensor(self.codec_id, kind, tuple(x.shape), payload, torch.empty(0, device=x.device))

    def _decode_into(self, enc: EncodedTensor, out: torch.Tensor) -> None:
        out.copy_(enc.payload.view(torch.bfloat16).view(enc.shape))

    def _error_bound(self, xf: torch.Tensor, kind: Kind) -> torch.Tensor:
        exact = xf.to(torch.bfloat16).to(torch.float32) == xf
        return torch.where(exact, 0.0, xf.abs().mul_(_UNIT_ROUNDOFF).add_(FLOAT32_TINY))


__all__ = ["Bf16Codec"]
