"""bf16: the cache's own bytes. Lossless against a bf16 cache.

Payload: the bf16 values, 2 bytes each, in [n_blocks, block_size, kv_heads, head_dim] order.
No scales. Bound: 0 for bf16 input; for float32 input, round-to-nearest to bf16, so
|err| <= 2^-8 * |x| (plus the float32 underflow floor).
"""

from __future__ import annotations

import torch

from kvtransfer.codecs.base import FLOAT32_TINY, Codec, Shape, raise_non_finite
from kvtransfer.codecs.types import CodecError, CodecId, EncodedTensor, Kind, WireLayout

_UNIT_ROUNDOFF = 2.0**-8


class Bf16Codec(Codec):
    name = "bf16"
    codec_id = CodecId.BF16

    def _layout(self, shape: Shape, kind: Kind) -> WireLayout:
        n, b, h, d = shape
        return WireLayout(payload_nbytes=n * b * h * d * 2, scales_shape=(0,), scales_dtype=torch.float32)

    def encode(self, x: torch.Tensor, kind: Kind | str) -> EncodedTensor:
        if isinstance(x, torch.Tensor) and x.dtype == torch.bfloat16:
            # Zero copy: the payload aliases the (contiguous) input.
            kind = Kind.parse(kind)
            shape = self._check_input(x)
            x = x.contiguous()
            _check_finite(x)
            payload = x.view(-1).view(torch.uint8)
            return EncodedTensor(self.codec_id, kind, shape, payload, torch.empty(0, device=x.device))
        return super().encode(x, kind)

    def _encode_chunk(
        self, xf: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, kind: Kind
    ) -> None:
        out = rows.view(torch.bfloat16).view(xf.shape)
        out.copy_(xf)
        _check_finite(out)  # after the cast, so float32 values beyond bf16's range are caught too

    def _decode_chunk(
        self, rows: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, kind: Kind, shape: Shape
    ) -> torch.Tensor:
        return rows.view(torch.bfloat16).view(shape)

    def max_abs_error_bound(
        self, x: torch.Tensor, kind: Kind | str, out_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        # The decoded values are bf16 already: no extra rounding for a bf16 destination.
        return super().max_abs_error_bound(x, kind, torch.float32)

    def _error_bound(self, xf: torch.Tensor, kind: Kind) -> torch.Tensor:
        return xf.abs().mul_(_UNIT_ROUNDOFF).add_(FLOAT32_TINY)


def _check_finite(t: torch.Tensor) -> None:
    lo, hi = torch.aminmax(t)  # one pass, no temporary; NaN propagates, inf shows as an extreme
    if not (torch.isfinite(lo) and torch.isfinite(hi)):
        raise_non_finite("bf16")


__all__ = ["Bf16Codec", "CodecError"]
