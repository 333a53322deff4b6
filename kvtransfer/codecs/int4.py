"""int4: asymmetric 4-bit, grouped KIVI-style, keys per channel and values per token.

Groups (G = 32, shrunk to fit a small block or head):
- keys: for each (block, head, channel), groups of min(32, block_size) consecutive tokens;
  scales/zeros float16 [n_blocks, block_size / Gk, kv_heads, head_dim];
- values: for each (block, token, head), groups of min(32, head_dim) consecutive channels;
  scales/zeros float16 [n_blocks, block_size, kv_heads, head_dim / Gv].
A group's zero point is its minimum rounded down to float16 and its scale its range / 15 rounded
up, so min + 15 * scale still covers the max; q = round((x - zero) / scale) in [0, 15].
Payload: two codes per byte, the even channel in the low nibble, in [n_blocks, block_size,
kv_heads, head_dim] order (head_dim / 2 bytes per head per token).

Constraints: head_dim even; block_size <= 32 or a multiple of 32; head_dim <= 32 or a multiple of
32; every group's |min| <= 65504 and range / 15 <= 65504 (float16), else CodecError.

Bound, elementwise with (lo, hi) its group's min and max:
    s = ((hi - lo) + max(2^-24, 2^-9 |lo|)) / 15 * (1 + 2^-9) + 2^-24,
    |err| <= s * (1/2 + 2^-12) + 2^-22 * (|x| + 16 s),
that is half a step of the float16-rounded scale, widened by float16's rounding of the zero point.
"""

from __future__ import annotations

import sys

import torch

from kvtransfer.codecs.base import Shape, divisor, raise_non_finite
from kvtransfer.codecs.blockwise import BlockwiseCodec
from kvtransfer.codecs.encoded import CodecError, CodecId, Kind, WireLayout

if sys.byteorder != "little":  # the packing reads byte pairs as little-endian int16
    raise ImportError("kvtransfer.codecs.int4 needs a little-endian host")

GROUP = 32
LEVELS = 15.0
_F16_MIN_STEP = 2.0**-24  # smallest float16 subnormal
_F16_MAX = 65504.0
_NEG_INF16 = torch.tensor(float("-inf"), dtype=torch.float16, device="cpu")
_POS_INF16 = torch.tensor(float("inf"), dtype=torch.float16, device="cpu")


def key_group(block_size: int) -> int:
    return min(GROUP, block_size)


def value_group(head_dim: int) -> int:
    return min(GROUP, head_dim)


class Int4Codec(BlockwiseCodec):
    name = "int4"
    max_code = float(LEVELS)
    codec_id = CodecId.INT4

    def _check_dims(self, shape: Shape) -> None:
        _, b, _, d = shape
        if d % 2:
            raise CodecError(f"int4 packs two channels per byte: head_dim must be even, got {d}")
        if b % key_group(b):
            raise CodecError(f"int4 key groups: block_size must be <= {GROUP} or a multiple of it, got {b}")
        if d % value_group(d):
            raise CodecError(f"int4 value groups: head_dim must be <= {GROUP} or a multiple of it, got {d}")

    def _layout(self, shape: Shape, kind: Kind) -> WireLayout:
        n, b, h, d = shape
        groups = (n, b // key_group(b), h, d) if kind is Kind.KEY else (n, b, h, d // value_group(d))
        return WireLayout(
            payload_nbytes=n * b * h * d // 2, scales_shape=groups, scales_dtype=torch.float16, zeros_shape=groups
        )

    def _encode_chunk(
        self,
        xf: torch.Tensor,
        rows: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        kind: Kind,
        aux: torch.Tensor | None,
    ) -> None:
        assert zeros is not None
        xg, gdim = _grouped(xf, kind)
        lo, hi = xg.amin(gdim), xg.amax(gdim)
        # the minimum of a group of signed zeros is either zero, by implementation (torch, numpy and a GPU
        # each pick theirs): +0 always, so every implementation puts the same zero point on the wire
        lo.masked_fill_(lo == 0, 0.0)
        if not (torch.isfinite(lo).all() and torch.isfinite(hi).all()):
            raise_non_finite(self.name)
        if lo.abs().amax() > _F16_MAX:
            raise CodecError(f"int4: a group's minimum is beyond float16's range (|min| must be <= {_F16_MAX:g})")
        zero16 = _round_down_f16(lo)
        zero = zero16.float()
        scale16 = _round_up_f16((hi - zero).div_(divisor(LEVELS, hi))).clamp_min_(_F16_MIN_STEP)
        if not torch.isfinite(scale16).all():
            raise CodecError(f"int4: a group's range / 15 is beyond float16's range ({_F16_MAX:g})")
        zeros.copy_(zero16)
        scales.copy_(scale16)
        inv = scale16.float().reciprocal_()
        xg.sub_(zero.unsqueeze(gdim)).mul_(inv.unsqueeze(gdim)).round_().clamp_(0.0, LEVELS)
        # Pack: codes to bytes, each (even, odd) byte pair read as one little-endian int16
        # v = even | odd << 8, so the low byte of v | v >> 4 is even | odd << 4. Pairs in
        # memory order never straddle a head, as head_dim is even.
        assert aux is not None
        codes = aux[: xf.numel()]
        codes.copy_(xf.view(-1))
        v = codes.view(torch.int16)
        packed16 = xf.view(-1).view(torch.int16)[: v.numel()]  # xf is spent: reuse its memory
        torch.bitwise_right_shift(v, 4, out=packed16).bitwise_or_(v)
        rows.view(-1).copy_(packed16)  # int16 -> uint8 keeps the low byte

    def _aux(self, numel: int, device: torch.device) -> torch.Tensor | None:
        return torch.empty(numel, dtype=torch.uint8, device=device)  # one code per byte

    def _decode_chunk(
        self,
        rows: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        kind: Kind,
        out: torch.Tensor,
        aux: torch.Tensor | None,
    ) -> None:
        assert zeros is not None and aux is not None
        packed = rows.reshape(-1)
        nibbles = aux[: packed.numel()]
        pairs = out.view(-1, 2)
        pairs[:, 0].copy_(torch.bitwise_and(packed, 0x0F, out=nibbles))
        pairs[:, 1].copy_(torch.bitwise_right_shift(packed, 4, out=nibbles))
        xg, gdim = _grouped(out, kind)
        xg.mul_(scales.float().unsqueeze(gdim)).add_(zeros.float().unsqueeze(gdim))

    def _error_bound(self, xf: torch.Tensor, kind: Kind) -> torch.Tensor:
        xg, gdim = _grouped(xf, kind)
        lo, hi = xg.amin(gdim, keepdim=True), xg.amax(gdim, keepdim=True)
        zero_slack = torch.clamp_min(lo.abs() * 2.0**-9, _F16_MIN_STEP)
        s = (hi - lo + zero_slack) / LEVELS * (1 + 2.0**-9) + _F16_MIN_STEP
        bound = s * (0.5 + 2.0**-12) + (xg.abs() + 16 * s) * 2.0**-22
        return bound.view(xf.shape)


def _grouped(x: torch.Tensor, kind: Kind) -> tuple[torch.Tensor, int]:
    """A view of contiguous [c, block, heads, dim] with the group axis split out, and that axis."""
    c, b, h, d = x.shape
    if kind is Kind.KEY:
        g = key_group(b)
        return x.view(c, b // g, g, h, d), 2
    g = value_group(d)
    return x.view(c, b, h, d // g, g), 4


def _round_down_f16(x: torch.Tensor) -> torch.Tensor:
    """The largest float16 <= x (float32 in); -inf below float16's range."""
    r = x.to(torch.float16)
    return torch.where(r.float() > x, torch.nextafter(r, _NEG_INF16.to(r.device)), r)


def _round_up_f16(x: torch.Tensor) -> torch.Tensor:
    """The smallest float16 >= x (float32 in); inf above float16's range."""
    r = x.to(torch.float16)
    return torch.where(r.float() < x, torch.nextafter(r, _POS_INF16.to(r.device)), r)


__all__ = ["GROUP", "Int4Codec", "key_group", "value_group"]
