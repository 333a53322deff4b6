"""int8: symmetric, one float32 scale per (block, head).

scale = max(amax(|x| over the block's tokens and head_dim) / 127, FLOAT32_TINY);
q = round(x / scale) clamped to [-127, 127]. Payload: int8 bytes in [n_blocks, block_size,
kv_heads, head_dim] order. Scales: float32 [n_blocks, kv_heads].

Bound, elementwise with s the (block, head) scale: |err| <= s / 2 (about amax / 254), plus
2^-12 * s and 2^-22 * |x| for the float32 arithmetic.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from kvtransfer.codecs import native
from kvtransfer.codecs.base import FLOAT32_TINY, Shape, divisor, raise_non_finite
from kvtransfer.codecs.blockwise import BlockwiseCodec
from kvtransfer.codecs.encoded import CodecError, CodecId, EncodedTensor, Kind, WireLayout, tensor_from_buffer

INT8_MAX = 127.0


class Int8Codec(BlockwiseCodec):
    name = "int8"
    max_code = 128.0  # the encoder writes [-127, 127]; a received payload may hold -128
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
        torch.div(amax, divisor(INT8_MAX, amax), out=scales).clamp_min_(FLOAT32_TINY)
        # No clamp pass: |x| <= amax, so |x * (1/scale)| <= 127 * (1 + 3 ulp), which rounds to 127.
        xf.mul_(scales.reciprocal().view(c, 1, h, 1)).round_()
        rows.view(torch.int8).view(xf.shape).copy_(xf)

    # -- the fused C kernels (kvtransfer.codecs.native), bit-identical to the eager code --
    def _encode_into(self, x: torch.Tensor, kind: Kind, layout: WireLayout, payload: torch.Tensor) -> EncodedTensor:
        lib = _native_for(x)
        if lib is None:
            return super()._encode_into(x, kind, layout, payload)
        n, b, h, d = x.shape
        scales = torch.empty(layout.scales_shape, dtype=torch.float32, device=x.device)
        rc = lib.kv_int8_encode(x.data_ptr(), int(x.dtype == torch.bfloat16), n, b, h, d, payload.data_ptr(),
                                scales.data_ptr())
        if rc:
            raise_non_finite(self.name)
        return EncodedTensor(self.codec_id, kind, (n, b, h, d), payload, scales)

    def _decode_into(self, enc: EncodedTensor, out: torch.Tensor) -> None:
        lib = _native_for(out)
        if lib is None or not (enc.payload.device.type == "cpu" and enc.scales.is_contiguous()):
            super()._decode_into(enc, out)
            return
        n, b, h, d = enc.shape
        lib.kv_int8_decode(enc.payload.data_ptr(), enc.scales.data_ptr(), n, b, h, d, out.data_ptr(),
                           int(out.dtype == torch.bfloat16))

    def decode_buffer_into(self, kind: Kind | str, shape: tuple[int, ...], payload: object, scales: object,
                           zeros: object | None, out: torch.Tensor) -> torch.Tensor:
        lib = _native_for(out)
        if lib is None or not isinstance(payload, (bytes, bytearray, memoryview)):
            return super().decode_buffer_into(kind, shape, payload, scales, zeros, out)
        kind = Kind.parse(kind)
        shape4 = self._check_shape(shape)
        layout = self._layout(shape4, kind)
        if tuple(out.shape) != shape4:
            raise CodecError(f"destination shape {tuple(out.shape)} != encoded shape {shape4}")
        if zeros is not None:
            tensor_from_buffer(zeros, layout.scales_dtype, 0, f"zeros (codec {self.name!r} takes none)")
        s = tensor_from_buffer(scales, torch.float32, layout.scale_nbytes, "scales")  # small; copied if read-only
        mv = memoryview(payload)
        if not mv.c_contiguous:
            raise CodecError("payload buffer must be contiguous")
        if mv.nbytes != layout.payload_nbytes:
            raise CodecError(f"payload has {mv.nbytes} bytes, expected {layout.payload_nbytes} for this codec, "
                             f"shape and kind")
        # numpy gives the address of read-only bytes without a copy; the kernel only reads them
        q = np.frombuffer(mv.cast("B"), dtype=np.uint8)
        n, b, h, d = shape4
        lib.kv_int8_decode(q.ctypes.data, s.data_ptr(), n, b, h, d, out.data_ptr(), int(out.dtype == torch.bfloat16))
        return out

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


def _native_for(t: torch.Tensor) -> ctypes.CDLL | None:
    """The C kernels when they apply to ``t`` (a contiguous CPU float32/bf16 tensor), else None."""
    if t.device.type != "cpu" or not t.is_contiguous() or t.dtype not in (torch.float32, torch.bfloat16):
        return None
    if t.dim() != 4 or t.shape[2] > native.MAX_HEADS:
        return None
    return native.load()


def _head_amax(x: torch.Tensor) -> torch.Tensor:
    """max |x| per (block, head) without an |x| temporary; NaN propagates, inf stays inf."""
    return torch.maximum(x.amax((1, 3)), x.amin((1, 3)).neg_())


__all__ = ["INT8_MAX", "Int8Codec"]
