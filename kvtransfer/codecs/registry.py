"""Codec registry: lookup by name or wire id, importing each codec's module on first use.

Adding a codec is a new module plus one `_Entry` line below. The registry is where a codec meets its
device kernels: each instance is built with kvtransfer.codecs.fused when that covers the codec, so
`Codec.encode`/`decode_into` run them on CUDA tensors (base.py only names their interface).
"""

from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass

from kvtransfer.codecs import fused
from kvtransfer.codecs.base import Codec
from kvtransfer.codecs.encoded import CodecError, CodecId

__all__ = ["available_codecs", "get_codec", "get_codec_by_id"]


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str
    codec_id: CodecId
    target: str  # "module:Class"


_ENTRIES: tuple[_Entry, ...] = (
    _Entry("bf16", CodecId.BF16, "kvtransfer.codecs.bf16:Bf16Codec"),
    _Entry("fp8", CodecId.FP8_E4M3, "kvtransfer.codecs.fp8:Fp8E4m3Codec"),
    _Entry("int8", CodecId.INT8, "kvtransfer.codecs.int8:Int8Codec"),
    _Entry("int4", CodecId.INT4, "kvtransfer.codecs.int4:Int4Codec"),
    _Entry("fp32", CodecId.FP32, "kvtransfer.codecs.fp32:Fp32Codec"),
)
_BY_NAME = {e.name: e for e in _ENTRIES}
_BY_ID = {e.codec_id: e for e in _ENTRIES}
_instances: dict[str, Codec] = {}
_lock = threading.Lock()


def available_codecs() -> tuple[str, ...]:
    """Registered codec names, in wire-id order."""
    return tuple(e.name for e in _ENTRIES)


def get_codec(name: str) -> Codec:
    """The shared codec instance for `name` ("bf16", "fp8", "int8", "int4")."""
    entry = _BY_NAME.get(name)
    if entry is None:
        raise CodecError(f"unknown codec {name!r}; known codecs: {', '.join(available_codecs())}")
    return _load(entry)


def get_codec_by_id(codec_id: CodecId | int) -> Codec:
    """The shared codec instance for a wire id (`CodecId` or its int value)."""
    try:
        entry = _BY_ID[CodecId(codec_id)]
    except (ValueError, KeyError):
        known = ", ".join(f"{int(e.codec_id)} ({e.name})" for e in _ENTRIES)
        raise CodecError(f"unknown codec id {codec_id!r}; known ids: {known}") from None
    return _load(entry)


def _load(entry: _Entry) -> Codec:
    codec = _instances.get(entry.name)
    if codec is not None:
        return codec
    with _lock:
        codec = _instances.get(entry.name)
        if codec is None:
            module_name, cls_name = entry.target.split(":")
            kernels = fused if entry.name in fused.FUSED_CODECS else None
            codec = getattr(importlib.import_module(module_name), cls_name)(kernels)
            if codec.name != entry.name or codec.codec_id != entry.codec_id:
                raise CodecError(f"registry entry {entry} does not match {codec!r}")
            _instances[entry.name] = codec
    return codec
