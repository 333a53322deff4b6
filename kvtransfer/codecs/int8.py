"""int8: symmetric, one float32 scale per (block, head).

scale = max(amax(|x| over the block's tokens and head_dim) / 127, FLOAT32_TINY);
q = round(x / scale) clamped to [-127, 127]. Payload: int8 bytes in [n_blocks, block_size,
kv_heads, head_dim] order. Scales: float32 [n_blocks, kv_heads].

Bound, elementwise with s the (block, head) scale: |err| <= s / 2 (about amax / 254), plus
2^-12 * s and 2^-22 * |x| for the float32 arithmetic.
"""

from __future__ import annotations

import torch

from kvtransfer.codecs.base import FLOAT32_TINY, Shape, raise_non_finite
from kvtransfer.codecs.blockwise import BlockwiseCodec
from kvtransfer.codecs.encoded import CodecId, Kind, WireLayout

INT8_MAX = 127.0


class Int8Codec(BlockwiseCodec):
    name = "int8"
    codec_id = CodecId.INT8

    def _layout(self, shape: Shape, kind: Kind) -> WireLayout:
        n, b, h, d = shape
        return WireLayout(payload_nbytes=n * b * h * d, scales_shape=(n, h), scales_dtype=torch.float32)

    def _encode_chunk(
        self,
        xf: torch.Tensor,
        rows: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        kind: Kind,
        aux: torch.Tensor | None,
    ) -> None:
        c, _, h, _ = xf.shape
        amax = _head_amax(xf)
        if not torch.isfinite(amax).all():
            raise_non_finite(self.name)
        torch.div(amax, INT8_MAX, out=scales).clamp_min_(FLOAT32_TINY)
        xf.mul_(scales.reciprocal().view(c, 1, h, 1)).round_().clamp_(-INT8_MAX, INT8_MAX)
        rows.view(torch.int8).view(xf.shape).copy_(xf)

    def _decode_chunk(
        self,
        rows: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        kind: Kind,
        out: torch.Tensor,
        aux: torch.Tensor | None,
    ) -> None:
        c, _, h, _ = out.shape
        out.copy_(rows.view(torch.int8).view(out.shape))
        out.mul_(scales.view(c, 1, h, 1))

    def _error_bound(self, xf: torch.Tensor, kind: Kind) -> torch.Tensor:
        n, _, h, _ = xf.shape
        s = (_head_amax(xf) / INT8_MAX).clamp_min_(FLOAT32_TINY).view(n, 1, h, 1)
        return s * (0.5 + 2.0**-12) + xf.abs() * 2.0**-22 + FLOAT32_TINY


def _head_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| per (block, head) without an |x| temporary; NaN propagates, inf stays inf."""
    return torch.maximum(x.amax((1, 3)), x.amin((1, 3)).neg_())


__all__ = ["INT8_MAX", "Int8Codec"]
