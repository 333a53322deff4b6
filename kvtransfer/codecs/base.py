"""The `Codec` interface: input checks, byte layouts, receiving, error bounds.

A codec turns one KV tensor [n_blocks, block_size, kv_heads, head_dim] (the keys or the values
of one layer) into an `EncodedTensor` and back.

Contracts every codec keeps:
- encode takes float32 or bfloat16, refuses NaN/inf with `CodecError` (a NaN in the KV cache is
  an upstream bug, never sent), and never mutates its input; the payload may alias the input
  (bf16 codec, bf16 input), so keep the input unchanged until the payload has been sent;
- `layout(shape, kind)` matches what encode produces, byte for byte;
- decode_into writes float32 or bfloat16 destinations of any strides;
- |decode(encode(x), d) - x| <= max_abs_error_bound(x, kind, d), elementwise.

Device kernels: a codec built with `kernels` (a `BlockKernels`, which the registry passes for the codecs
kvtransfer.codecs.fused covers) runs them for CUDA tensors when they are usable there; every other tensor,
and a codec built without them, runs the codec's own torch (and native C) code. Both give the same bytes.
This module only names the interface, so it depends on no implementation of it.
"""

from __future__ import annotations

import abc
from typing import ClassVar, Protocol

import torch

from kvtransfer.codecs.encoded import CodecError, CodecId, EncodedTensor, Kind, WireLayout, tensor_from_buffer

__all__ = ["CACHE_DTYPES", "FLOAT32_TINY", "BlockKernels", "Codec", "Shape", "divisor", "raise_non_finite"]

Shape = tuple[int, int, int, int]

# Smallest normal float32: the floor for scales, so 1/scale stays finite.
FLOAT32_TINY = torch.finfo(torch.float32).tiny
CACHE_DTYPES = (torch.float32, torch.bfloat16)
_BF16_UNIT_ROUNDOFF = 2.0**-8


class BlockKernels(Protocol):
    """A codec's device kernels, addressed by cache block index (kvtransfer.codecs.fused is one).

    ``encode_blocks`` encodes blocks ``ids`` (1-D long, the cache's device) of ``cache`` [num_blocks,
    block_size, kv_heads, head_dim] into ``payload`` (1-D uint8 of the layout's size, same device) with
    exactly the codec's torch bytes, refusing what it refuses; ``decode_blocks`` writes ``enc`` decoded
    straight into cache blocks ``ids``."""

    def usable(self, device: torch.device) -> bool: ...

    def encode_blocks(self, codec: Codec, cache: torch.Tensor, ids: torch.Tensor, kind: Kind | str,
                      payload: torch.Tensor) -> EncodedTensor: ...

    def decode_blocks(self, codec: Codec, enc: EncodedTensor, cache: torch.Tensor, ids: torch.Tensor) -> None: ...


class Codec(abc.ABC):
    """One KV codec. Stateless and thread-safe; the registry hands out one shared instance, built with
    the codec's device kernels where it has them."""

    name: ClassVar[str]
    codec_id: ClassVar[CodecId]
    # True when decoded values are bf16 already, so a bf16 destination adds no rounding.
    decodes_to_bf16: ClassVar[bool] = False
    # The largest |code| a payload can hold, for a codec with scales: a decoded value's magnitude is at most
    # max_code * |scale| + |zero point|. 0 for a codec without scales (its payload is the values).
    max_code: ClassVar[float] = 0.0

    def __init__(self, kernels: BlockKernels | None = None) -> None:
        self._kernels = kernels

    # -- what subclasses provide ------------------------------------------------------------
    @abc.abstractmethod
    def _layout(self, shape: Shape, kind: Kind) -> WireLayout:
        """The layout of an already validated 4-D shape."""

    @abc.abstractmethod
    def _encode(self, x: torch.Tensor, kind: Kind, layout: WireLayout) -> EncodedTensor:
        """Encode a validated contiguous float32/bf16 tensor."""

    @abc.abstractmethod
    def _decode_into(self, enc: EncodedTensor, out: torch.Tensor) -> None:
        """Decode a checked `enc` into a checked destination."""

    @abc.abstractmethod
    def _error_bound(self, xf: torch.Tensor, kind: Kind) -> torch.Tensor:
        """Elementwise bound for a float32 decode of float32 `xf`, broadcastable to xf."""

    def _check_dims(self, shape: Shape) -> None:  # noqa: B027 (optional hook: most codecs take any shape)
        """Codec-specific shape constraints; raise CodecError."""

    # -- layout -----------------------------------------------------------------------------
    def layout(self, shape: tuple[int, ...], kind: Kind | str) -> WireLayout:
        """Byte sizes and scale shapes of `shape` encoded as `kind`, without encoding anything."""
        return self._layout(self._check_shape(shape), Kind.parse(kind))

    def payload_nbytes(self, shape: tuple[int, ...], kind: Kind | str) -> int:
        return self.layout(shape, kind).payload_nbytes

    def scale_nbytes(self, shape: tuple[int, ...], kind: Kind | str) -> int:
        return self.layout(shape, kind).scale_nbytes

    def zero_nbytes(self, shape: tuple[int, ...], kind: Kind | str) -> int:
        return self.layout(shape, kind).zero_nbytes

    # -- encode / decode --------------------------------------------------------------------
    def encode(self, x: torch.Tensor, kind: Kind | str) -> EncodedTensor:
        """Encode a float32/bfloat16 tensor [n_blocks, block_size, kv_heads, head_dim]."""
        kind = Kind.parse(kind)
        shape = self._check_input(x)
        layout = self._layout(shape, kind)
        fused = self._fused(x)
        if fused is not None:
            payload = torch.empty(layout.payload_nbytes, dtype=torch.uint8, device=x.device)
            return fused.encode_blocks(self, x, _all_blocks(x), kind, payload)
        return self._encode(x.contiguous(), kind, layout)

    def encode_into(self, x: torch.Tensor, kind: Kind | str, payload: torch.Tensor) -> EncodedTensor:
        """Encode like `encode`, writing the payload into `payload` (1-D contiguous uint8 of the
        layout's payload size, e.g. a view of a shared-memory segment or an outgoing buffer).

        The returned tensor's payload is `payload`; scales and zeros are small and freshly allocated.
        Why: the sender then writes each payload byte once, where it is sent from. This default
        encodes and copies; codecs override it to write there directly."""
        kind = Kind.parse(kind)
        shape = self._check_input(x)
        layout = self._layout(shape, kind)
        _check_payload_out(payload, layout.payload_nbytes)
        fused = self._fused(x)
        if fused is not None and payload.device == x.device:
            return fused.encode_blocks(self, x, _all_blocks(x), kind, payload)
        return self._encode_into(x.contiguous(), kind, layout, payload)

    def _encode_into(self, x: torch.Tensor, kind: Kind, layout: WireLayout, payload: torch.Tensor) -> EncodedTensor:
        enc = self._encode(x, kind, layout)
        payload.copy_(enc.payload)
        return EncodedTensor(self.codec_id, kind, enc.shape, payload, enc.scales, enc.zeros)

    def decode(self, enc: EncodedTensor, out_dtype: torch.dtype) -> torch.Tensor:
        """Decode into a new contiguous tensor of `out_dtype` (float32 or bfloat16)."""
        if out_dtype not in CACHE_DTYPES:
            raise CodecError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
        return self.decode_into(enc, torch.empty(enc.shape, dtype=out_dtype, device=enc.payload.device))

    def decode_into(self, enc: EncodedTensor, out: torch.Tensor) -> torch.Tensor:
        """Decode into a preallocated float32/bf16 tensor of `enc.shape`, any strides; returns `out`.

        This is the receiver's path: `out` can be the cache's own blocks.
        """
        self.check(enc)
        if tuple(out.shape) != enc.shape:
            raise CodecError(f"destination shape {tuple(out.shape)} != encoded shape {enc.shape}")
        if out.dtype not in CACHE_DTYPES:
            raise CodecError(f"destination dtype must be float32 or bfloat16, got {out.dtype}")
        fused = self._fused(out)
        if fused is not None and enc.payload.device == out.device:
            fused.decode_blocks(self, enc, out, _all_blocks(out))
            return out
        self._decode_into(enc, out)
        return out

    def _fused(self, t: torch.Tensor) -> BlockKernels | None:
        """This codec's device kernels for a CUDA tensor when it has them and they are usable there,
        else None: CPU tensors keep this codec's torch (and native C) kernels."""
        if t.device.type != "cuda" or self._kernels is None:
            return None
        return self._kernels if self._kernels.usable(t.device) else None

    # -- receiving --------------------------------------------------------------------------
    def check(self, enc: EncodedTensor) -> None:
        """Raise CodecError unless `enc` is this codec's and its parts have the layout's sizes."""
        if enc.codec_id != self.codec_id:
            raise CodecError(
                f"codec {self.name!r} (id {int(self.codec_id)}) cannot decode codec id {int(enc.codec_id)}"
            )
        layout = self.layout(enc.shape, enc.kind)
        if enc.payload.nbytes != layout.payload_nbytes:
            raise CodecError(f"payload has {enc.payload.nbytes} bytes, expected {layout.payload_nbytes}")
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
            raise CodecError(
                f"zeros are {enc.zeros.dtype} {tuple(enc.zeros.shape)}, "
                f"expected {layout.scales_dtype} {layout.zeros_shape}"
            )

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
        For a codec without zero points, `zeros` may be None or empty.
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
            tensor_from_buffer(zeros, layout.scales_dtype, 0, f"zeros (codec {self.name!r} takes none)")
        return EncodedTensor(self.codec_id, kind, shape4, p, s.view(layout.scales_shape), z)

    def decode_buffer_into(
        self,
        kind: Kind | str,
        shape: tuple[int, ...],
        payload: object,
        scales: object,
        zeros: object | None,
        out: torch.Tensor,
    ) -> torch.Tensor:
        """`from_buffer` then `decode_into`, for a receiver holding received bytes and its cache slice.

        Codecs may override it to read the bytes where they lie: a received message is read-only,
        so `from_buffer` would copy its payload once more just to wrap it as a tensor."""
        return self.decode_into(self.from_buffer(kind, shape, payload, scales, zeros), out)

    # -- error bound ------------------------------------------------------------------------
    def max_abs_error_bound(
        self, x: torch.Tensor, kind: Kind | str, out_dtype: torch.dtype = torch.float32
    ) -> torch.Tensor:
        """An elementwise bound on |decode(encode(x), out_dtype) - x|, broadcastable to x."""
        kind = Kind.parse(kind)
        self._check_input(x)
        if out_dtype not in CACHE_DTYPES:
            raise CodecError(f"out_dtype must be float32 or bfloat16, got {out_dtype}")
        xf = x.to(torch.float32)
        bound = self._error_bound(xf, kind)
        if out_dtype == torch.bfloat16 and not self.decodes_to_bf16:
            # Rounding the float32 result to bf16 adds at most half an ulp of |x| + bound.
            bound = bound + _BF16_UNIT_ROUNDOFF * (xf.abs() + bound) + FLOAT32_TINY
        return bound

    # -- helpers ----------------------------------------------------------------------------
    def _check_shape(self, shape: tuple[int, ...]) -> Shape:
        dims = tuple(int(d) for d in shape)
        if len(dims) != 4 or any(d < 1 for d in dims):
            raise CodecError(f"shape must be [n_blocks, block_size, kv_heads, head_dim], all >= 1; got {dims}")
        shape4: Shape = (dims[0], dims[1], dims[2], dims[3])
        self._check_dims(shape4)
        return shape4

    def _check_input(self, x: torch.Tensor) -> Shape:
        if not isinstance(x, torch.Tensor):
            raise CodecError(f"expected a torch.Tensor, got {type(x).__name__}")
        if x.dtype not in CACHE_DTYPES:
            raise CodecError(f"codec {self.name!r} takes float32 or bfloat16 tensors, got {x.dtype}")
        return self._check_shape(tuple(x.shape))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} id={int(self.codec_id)}>"


def _check_payload_out(payload: torch.Tensor, nbytes: int) -> None:
    if not isinstance(payload, torch.Tensor) or payload.dtype != torch.uint8 or payload.dim() != 1:
        raise CodecError("payload destination must be a 1-D uint8 tensor")
    if not payload.is_contiguous() or payload.numel() != nbytes:
        raise CodecError(f"payload destination must be contiguous with {nbytes} bytes, got {payload.numel()}")


def _all_blocks(x: torch.Tensor) -> torch.Tensor:
    return torch.arange(x.shape[0], dtype=torch.long, device=x.device)


def raise_non_finite(codec: str) -> None:
    """The one message for NaN/inf input, shared by the codecs."""
    raise CodecError(f"{codec}: input holds NaN or inf; refusing to encode a corrupt KV cache")


def divisor(value: float, like: torch.Tensor) -> torch.Tensor:
    """``value`` as a float32 0-d tensor on ``like``'s device, to divide by. CUDA turns division by a
    Python number into a multiply by its reciprocal, one bit off the CPU's (and the Triton kernels')
    IEEE division for some inputs; a divisor on the same device divides exactly on both, so a torch
    codec writes the same wire bytes on any device."""
    return torch.full((), value, dtype=torch.float32, device=like.device)
