"""fp8: float8 e4m3 (torch.float8_e4m3fn) with one float32 scale per block.

scale = max(amax(|x| over the block, all heads and dims) / 448, FLOAT32_TINY); payload = the fp8
bytes of x / scale, in [n_blocks, block_size, kv_heads, head_dim] order. Scales: float32 [n_blocks].

Bound, elementwise with s the block's scale: |err| <= 2^-4 * |x| + 2^-10 * s, half an fp8 ulp for
normal values (3 mantissa bits) and half the subnormal step (2^-9 * s) below them; a 2^-20
relative term covers the float32 arithmetic.
"""

from __future__ import annotations

import torch

from kvtransfer.codecs.base import FLOAT32_TINY, Shape, divisor, raise_non_finite
from kvtransfer.codecs.blockwise import BlockwiseCodec
from kvtransfer.codecs.encoded import CodecId, Kind, WireLayout

FP8_MAX = 448.0
_REL = 2.0**-4
_SUBNORMAL_HALF_STEP = 2.0**-10
_SLACK = 2.0**-20
# float32 value of every fp8 byte, from torch's own cast.
_DECODE_TABLE = torch.arange(256, dtype=torch.uint8, device="cpu").view(torch.float8_e4m3fn).to(torch.float32)


class Fp8E4m3Codec(BlockwiseCodec):
    name = "fp8"
    max_code = FP8_MAX
    codec_id = CodecId.FP8_E4M3

    def _layout(self, shape: Shape, kind: Kind) -> WireLayout:
        n, b, h, d = shape
        return WireLayout(payload_nbytes=n * b * h * d, scales_shape=(n,), scales_dtype=torch.float32)

    def _encode_chunk(
        self,
        xf: torch.Tensor,
        rows: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        kind: Kind,
        aux: torch.Tensor | None,
    ) -> None:
        flat = xf.view(xf.shape[0], -1)
        amax = _block_amax(flat)
        if not torch.isfinite(amax).all():
            raise_non_finite(self.name)
        torch.div(amax, divisor(FP8_MAX, amax), out=scales).clamp_min_(FLOAT32_TINY)
        # The clamp only trims float32 rounding above 448; it keeps any cast from saturating.
        flat.mul_(scales.reciprocal().unsqueeze(1)).clamp_(-FP8_MAX, FP8_MAX)
        rows.view(torch.float8_e4m3fn).copy_(flat)

    def _aux(self, numel: int, device: torch.device) -> torch.Tensor | None:
        return torch.empty(numel, dtype=torch.int32, device=device)

    def _decode_chunk(
        self,
        rows: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        kind: Kind,
        out: torch.Tensor,
        aux: torch.Tensor | None,
    ) -> None:
        # A 256-entry table lookup, same values as torch's fp8 -> float32 cast: on CPU that cast is slower.
        assert aux is not None
        codes = aux[: rows.numel()]
        codes.copy_(rows.reshape(-1))
        torch.index_select(_DECODE_TABLE.to(rows.device), 0, codes, out=out.view(-1))
        out.view(rows.shape[0], -1).mul_(scales.unsqueeze(1))

    def _error_bound(self, xf: torch.Tensor, kind: Kind) -> torch.Tensor:
        n = xf.shape[0]
        s = (_block_amax(xf.reshape(n, -1)) / FP8_MAX).clamp_min_(FLOAT32_TINY).view(n, 1, 1, 1)
        ax = xf.abs()
        return ax * (_REL + _SLACK) + s * (_SUBNORMAL_HALF_STEP + _SLACK) + FLOAT32_TINY


def _block_amax(flat: torch.Tensor) -> torch.Tensor:
    """max |x| per row without an |x| temporary; NaN propagates, inf stays inf."""
    return torch.maximum(flat.amax(1), flat.amin(1).neg_())


__all__ = ["FP8_MAX", "Fp8E4m3Codec"]
