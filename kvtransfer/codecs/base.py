"""The `Codec` base class: input checks, the blockwise encode/decode loop, byte layouts, bounds.

A codec turns one KV tensor [n_blocks, block_size, kv_heads, head_dim] (keys or values of one
layer) into an `EncodedTensor` and back. Subclasses supply the per-chunk kernels and their
layout; this class owns everything they share.

Contracts every codec keeps:
- encode refuses NaN/inf with `CodecError` (a NaN in the KV cache is an upstream bug);
- encode never mutates its input; the payload may alias it (bf16 codec, bf16 input), so keep
  the input unchanged until the payload has been sent;
- `layout(shape, kind)` matches what encode produces, byte for byte;
- `|decode(encode(x)) - x| <= max_abs_error_bound(x, kind, out_dtype)` elementwise.

Why chunks: the kernels run over a few hundred blocks at a time so their float32 scratch stays
in cache and is recycled by the allocator, instead of page-faulting a fresh temporary twice the
input's size; on one core that makes int8 about 3x faster to encode and 8x faster to decode.
Each chunk is still one vectorised pass over all its blocks and heads.
"""

from __future__ import annotations

import abc
from typing import ClassVar

import torch

from kvtransfer.codecs.types import (
    CodecError,
    CodecId,
    EncodedTensor,
    Kind,
    WireLayout,
    tensor_from_buffer,
)

__all__ = ["CHUNK_ELEMENTS", "FLOAT32_TINY", "Codec", "Shape", "raise_non_finite"]

Shape = tuple[int, int, int, int]

# Elements per kernel call: 2 MiB of float32 scratch, measured best on this machine (1-8 MiB flat).
CHUNK_ELEMENTS = 1 << 19
# Smallest normal float32: the floor for scales, so 1/scale stays finite.
FLOAT32_TINY = torch.finfo(torch.float32).tiny
_CACHE_DTYPES = (torch.float32, torch.bfloat16)
_BF16_UNIT_ROUNDOFF = 2.0**-8


class Codec(abc.ABC):
    """One KV codec. Stateless and thread-safe; the registry hands out one shared instance."""

    name: ClassVar[str]
    codec_id: ClassVar[CodecId]

    # -- layout -----------------------------------------------------------------------------
    @abc.abstractmethod
    def _layout(self, shape: Shape, kind: Kind) -> WireLayout:
        """The layout of an already validated 4-D shape."""

    def layout(self, shape: tuple[int, ...], kind: Kind | str) -> WireLayout:
        """Byte sizes and scale shapes of `shape` encoded as `kind`, without encoding anything."""
        return self._layout(self._check_shape(shape), Kind.parse(kind))

    def payload_nbytes(self, shape: tuple[int, ...], kind: Kind | str) -> int:
        return self.layout(shape, kind).payload_nbytes

    def scale_nbytes(self, shape: tuple[int, ...], kind: Kind | str) -> int:
        return self.layout(shape, kind).scale_nbytes

    def zero_nbytes(self, shape: tuple[int, ...], kind: Kind | str) -> int:
        return self.layout(shape, kind).zero_nbytes

    # -- encode -----------------------------------------------------------------------------
    def encode(self, x: torch.Tensor, kind: Kind | str) -> EncodedTensor:
        """Encode a float32/bfloat16 tensor [n_blocks, block_size, kv_heads, head_dim]."""
        kind = Kind.parse(kind)
        shape = self._check_input(x)
        layout = self._layout(shape, kind)
        x = x.contiguous()
        payload = torch.empty(layout.payload_nbytes, dtype=torch.uint8, device=x.device)
        scales = torch.empty(layout.scales_shape, dtype=layout.scales_dtype, device=x.device)
        zeros = None
        if layout.zeros_shape is not None:
            zeros = torch.empty(layout.zeros_shape, dtype=layout.scales_dtype, device=x.device)
        rows = payload.view(shape[0], -1)
        for sl in self._chunks(shape):
            # A fresh float32 copy: kernels work in place on it.
            xf = x[sl].to(torch.float32, copy=True)
            self._encode_chunk(xf, rows[sl], scales[sl], None if zeros is None else zeros[sl], kind)
        return EncodedTensor(self.codec_id, kind, shape, payload, scales, zeros)

    @abc.abstractmethod
    def _encode_chunk(
        self, xf: torch.Tensor, rows: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, kind: Kind
    ) -> None:
        """Encode float32 blocks `xf` (scratch, may be clobbered) into the given output slices.

        Raises CodecError if `xf` holds NaN/inf.
        """

    # -- decode -----------------------------------------------------------------------------
    def decode(self, enc: EncodedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Decode into a new contiguous tensor of `out_dtype` (float32 or bfloat16)."""
        out = torch.empty(enc.shape, dtype=out_dtype, device=enc.payload.device)
        return self.decode_into(enc, out)

    def decode_into(self, enc: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
        """Decode into a preallocated float32/bfloat16 tensor of `enc.shape` (any strides); returns it."""
        self.check(enc)
        if tuple(out.shape) != enc.shape:
            raise CodecError(f"destination shape {tuple(out.shape)} != encoded shape {enc.shape}")
        if out.dtype not in _CACHE_DTYPES:
            raise CodecError(f"destination dtype must be float32 or bfloat16, got {out.dtype}")
        rows = enc.payload.view(enc.shape[0], -1)
        for sl in self._chunks(enc.shape):
            zeros = None if enc.zeros is None else enc.zeros[sl]
            shape = (rows[sl].shape[0], *enc.shape[1:])
            out[sl].copy_(self._decode_chunk(rows[sl], enc.scales[sl], zeros, enc.kind, shape))  # type: ignore[arg-type]
        return out

    @abc.abstractmethod
    def _decode_chunk(
        self, rows: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, kind: Kind, shape: Shape
    ) -> torch.Tensor:
        """Decode payload rows [c, bytes_per_block] to a tensor of `shape` ([c, block, heads, dim]).

        The result is float32 (or bf16 where that is exact); the caller copies it into place.
        """

    # -- receiving --------------------------------------------------------------------------
    def check(self, enc: EncodedTensor) -> None:
        """Raise CodecError unless `enc` is this codec's and its parts have the layout's sizes."""
        if enc.codec_id != self.codec_id:
            raise CodecError(f"codec {self.name!r} (id {int(self.codec_id)}) cannot decode codec id {int(enc.codec_id)}")
        layout = self.layout(enc.shape, enc.kind)
        _check_part("payload", enc.payload.nbytes, layout.payload_nbytes)
        if enc.scales.dtype != layout.scales_dtype or tuple(enc.scales.shape) != layout.scales_shape:
            raise CodecError(
                f"scales are {enc.scales.dtype} {tuple(enc.scales.shape)}, "
                f"expected {layout.scales_dtype} {layout.scales_shape}"
            )
        if (enc.zeros is None) != (layout.zeros_shape is None):
            raise CodecError(f"codec {self.name!r} {'needs' if enc.zeros is None else 'takes no'} zero points")
        if enc.zeros is not None and (
            enc.zeros.dtype != layout.scales_dtype or tuple(enc.zeros.shape) != layout.zeros_shape
        ):
            raise CodecError(f"zeros are {enc.zeros.dtype} {tuple(enc.zeros.shape)}, expected {layout.zeros_shape}")

    def from_buffer(
        self,
        kind: Kind | str,
        shape: tuple[int, ...],
        payload: object,
        scales: object,
        zeros: object | None = None,
    ) -> EncodedTensor:
        """Rebuild an `EncodedTensor` from received bytes, checking every length against `shape`.

        Writable buffers are shared, read-only ones (bytes) copied once; see `tensor_from_buffer`.
        """
        kind = Kind.parse(kind)
        shape4 = self._check_shape(shape)
        layout = self._layout(shape4, kind)
        p = tensor_from_buffer(payload, torch.uint8, layout.payload_nbytes, "payload")
        s = tensor_from_buffer(scales, layout.scales_dtype, layout.scale_nbytes, "scales")
        z = None
        if layout.zeros_shape is not None:
            if zeros is None:
                raise CodecError(f"codec {self.name!r} needs zero points ({layout.zero_nbytes} bytes), got none")
            z = tensor_from_buffer(zeros, layout.scales_dtype, layout.zero_nbytes, "zeros").view(layout.zeros_shape)
        elif zeros is not None:
            # An empty field is how a wire without optional fields says "none".
            tensor_from_buffer(zeros, layout.scales_dtype, 0, f"zeros (codec {self.name!r} takes none)")
        return EncodedTensor(self.codec_id, kind, shape4, p, s.view(layout.scales_shape), z)

    # -- error bound ------------------------------------------------------------------------
    def max_abs_error_bound(
        self, x: torch.Tensor, kind: Kind | str, out_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """An elementwise bound on |decode(encode(x), out_dtype) - x|, broadcastable to x."""
        kind = Kind.parse(kind)
        self._check_input(x)
        if out_dtype not in _CACHE_DTYPES:
            raise CodecError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
        xf = x.to(torch.float32)
        bound = self._error_bound(xf, kind)
        if out_dtype == torch.bfloat16:
            # Rounding the float32 result to bf16 adds at most half an ulp of |x| + bound.
            bound = bound + _BF16_UNIT_ROUNDOFF * (xf.abs() + bound) + FLOAT32_TINY
        return bound

    @abc.abstractmethod
    def _error_bound(self, xf: torch.Tensor, kind: Kind) -> torch.Tensor:
        """Elementwise bound for a float32 decode of float32 `xf`, broadcastable to xf."""

    # -- helpers ----------------------------------------------------------------------------
    def _check_shape(self, shape: tuple[int, ...]) -> Shape:
        dims = tuple(int(d) for d in shape)
        if len(dims) != 4 or any(d < 1 for d in dims):
            raise CodecError(f"shape must be [n_blocks, block_size, kv_heads, head_dim], all >= 1; got {dims}")
        self._check_dims(dims)  # type: ignore[arg-type]
        return dims  # type: ignore[return-value]

    def _check_dims(self, shape: Shape) -> None:
        """Codec-specific shape constraints; raise CodecError."""

    def _check_input(self, x: torch.Tensor) -> Shape:
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in _CACHE_DTYPES:
            raise CodecError(f"codec {self.name!r} takes float32 or bfloat16 tensors, got {x.dtype}")
        return self._check_shape(tuple(x.shape))

    @staticmethod
    def _chunks(shape: tuple[int, ...]) -> list[slice]:
        n, per_block = shape[0], shape[1] * shape[2] * shape[3]
        step = max(1, CHUNK_ELEMENTS // per_block)
        return [slice(i, min(i + step, n)) for i in range(0, n, step)]

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} id={int(self.codec_id)}>"


def _check_part(what: str, got: int, expected: int) -> None:
    if got != expected:
        raise CodecError(f"{what} has {got} bytes, expected {expected}")


def raise_non_finite(codec: str) -> None:
    """The one message for NaN/inf input, shared by the codecs."""
    raise CodecError(f"{codec}: input holds NaN or inf; refusing to encode a corrupt KV cache")
