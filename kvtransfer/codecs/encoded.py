"""Value types shared by every codec: ids, kinds, the encoded form, its wire layout, errors.

`EncodedTensor` is what a codec hands to the transport and what the transport rebuilds on
the receiving side with `Codec.from_buffer`; `WireLayout` says, from the shape alone, how
many bytes each of its parts must have, so a receiver can check a chunk before reading it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TypeVar

import torch

__all__ = [
    "CodecError",
    "CodecId",
    "EncodedTensor",
    "Kind",
    "WireLayout",
    "as_memoryview",
    "tensor_from_buffer",
]


class CodecError(ValueError):
    """Bad input to a codec: unknown codec, malformed chunk, non-finite or out-of-range values."""


def non_finite_landing(codec: str, cache_dtype: str) -> CodecError:
    """The refusal of a received chunk that decodes to NaN or inf, raised before any of it lands in a
    quantised cache: the same words whichever path (torch or fused kernel) found it."""
    return CodecError(f"{codec}: the received KV holds NaN or inf once decoded; refusing to land it in the "
                      f"{cache_dtype} cache (nothing was written)")


class CodecId(enum.IntEnum):
    """Codec ids as they travel on the wire; proto/ mirrors these (0 stays 'unspecified' there)."""

    BF16 = 1
    FP8_E4M3 = 2
    INT8 = 3
    INT4 = 4
    FP32 = 5


class Kind(enum.StrEnum):
    """Which half of the KV cache a tensor is; int4 quantises keys and values along different axes."""

    KEY = "key"
    VALUE = "value"

    @classmethod
    def parse(cls, kind: Kind | str) -> Kind:
        try:
            return cls(kind)
        except ValueError:
            raise CodecError(f"unknown kind {kind!r}; expected one of {[k.value for k in cls]}") from None


@dataclass(frozen=True, slots=True)
class WireLayout:
    """Sizes of an encoded tensor's parts, a pure function of (codec, shape, kind)."""

    payload_nbytes: int
    scales_shape: tuple[int, ...]
    scales_dtype: torch.dtype
    zeros_shape: tuple[int, ...] | None = None  # same dtype as scales when present

    @property
    def scale_nbytes(self) -> int:
        return _numel(self.scales_shape) * _itemsize(self.scales_dtype)

    @property
    def zero_nbytes(self) -> int:
        return 0 if self.zeros_shape is None else _numel(self.zeros_shape) * _itemsize(self.scales_dtype)

    @property
    def total_nbytes(self) -> int:
        return self.payload_nbytes + self.scale_nbytes + self.zero_nbytes


Sliceable = TypeVar("Sliceable", memoryview, torch.Tensor)


def cut_pair(k_lay: WireLayout, v_lay: WireLayout, scales: Sliceable,
             payload: Sliceable) -> tuple[tuple[Sliceable, Sliceable, Sliceable | None],
                                          tuple[Sliceable, Sliceable, Sliceable | None]]:
    """Cut one chunk's scales region (k scales, k zeros, v scales, v zeros) and payload (k, v) into each
    tensor's (payload, scales, zeros): slices of what was given (memoryviews or 1-D uint8 tensors), no copy."""
    o = 0
    parts = []
    for lay in (k_lay, v_lay):
        s = scales[o:o + lay.scale_nbytes]
        o += lay.scale_nbytes
        z = scales[o:o + lay.zero_nbytes] if lay.zero_nbytes else None
        o += lay.zero_nbytes
        parts.append((s, z))
    kp, vp = payload[:k_lay.payload_nbytes], payload[k_lay.payload_nbytes:]
    return (kp, parts[0][0], parts[0][1]), (vp, parts[1][0], parts[1][1])


@dataclass(frozen=True, slots=True)
class EncodedTensor:
    """One encoded KV tensor of logical shape [n_blocks, block_size, kv_heads, head_dim].

    payload: 1-D contiguous uint8. scales/zeros: contiguous float32 or float16, in the shape
    the codec's `WireLayout` gives. The bf16 codec's payload may alias the input tensor.
    """

    codec_id: CodecId
    kind: Kind
    shape: tuple[int, int, int, int]
    payload: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "codec_id", _parse_codec_id(self.codec_id))
        object.__setattr__(self, "kind", Kind.parse(self.kind))
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))
        p = self.payload
        if p.dtype != torch.uint8 or p.dim() != 1 or not p.is_contiguous():
            raise CodecError(f"payload must be a contiguous 1-D uint8 tensor, got {p.dtype} {tuple(p.shape)}")
        for name, t in (("scales", self.scales), ("zeros", self.zeros)):
            if t is None:
                continue
            if t.dtype not in (torch.float32, torch.float16) or not t.is_contiguous():
                raise CodecError(f"{name} must be a contiguous float32/float16 tensor, got {t.dtype}")

    @property
    def nbytes(self) -> int:
        """Bytes on the wire for payload, scales and zeros (framing not included)."""
        z = 0 if self.zeros is None else self.zeros.nbytes
        return self.payload.nbytes + self.scales.nbytes + z

    @property
    def logical_nbytes(self) -> int:
        """Bytes of the same tensor in bf16, the reference for compression ratios and metrics."""
        return _numel(self.shape) * 2

    def payload_view(self) -> memoryview:
        """The payload as a byte memoryview sharing the tensor's memory (no copy; CPU only)."""
        return as_memoryview(self.payload)

    def scales_view(self) -> memoryview:
        return as_memoryview(self.scales)

    def zeros_view(self) -> memoryview | None:
        return None if self.zeros is None else as_memoryview(self.zeros)


def as_memoryview(t: torch.Tensor) -> memoryview:
    """A flat byte view of a contiguous CPU tensor's memory, via numpy, without copying."""
    if t.device.type != "cpu":
        raise CodecError(f"byte views need a CPU tensor, got one on {t.device}")
    if not t.is_contiguous():
        raise CodecError("byte views need a contiguous tensor")
    return t.detach().reshape(-1).numpy().data.cast("B")


def tensor_from_buffer(buf: object, dtype: torch.dtype, nbytes: int, what: str) -> torch.Tensor:
    """Wrap a bytes-like object as a 1-D tensor of `dtype`, checking it has exactly `nbytes`.

    A writable buffer (bytearray, numpy array, writable memoryview) is shared without a copy;
    a read-only one (bytes, as protobuf hands them out) is copied once, because torch cannot
    hold read-only memory without warning. None stands for an empty part.
    """
    if buf is None and nbytes == 0:
        return torch.empty(0, dtype=dtype, device="cpu")
    try:
        mv = memoryview(buf)  # type: ignore[arg-type]  # any object: a non-buffer is refused just below
    except TypeError:
        raise CodecError(f"{what} must be a bytes-like object, got {type(buf).__name__}") from None
    if not mv.c_contiguous:
        raise CodecError(f"{what} buffer must be contiguous")
    if mv.nbytes != nbytes:
        raise CodecError(f"{what} has {mv.nbytes} bytes, expected {nbytes} for this codec, shape and kind")
    if nbytes == 0:
        return torch.empty(0, dtype=dtype, device="cpu")
    mv = mv.cast("B")
    source: object = bytearray(mv) if mv.readonly else mv
    return torch.frombuffer(source, dtype=dtype)


def _parse_codec_id(codec_id: CodecId | int) -> CodecId:
    try:
        return CodecId(codec_id)
    except ValueError:
        raise CodecError(f"unknown codec id {codec_id!r}; known: {[int(c) for c in CodecId]}") from None


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return dtype.itemsize
