"""KV-cache codecs: bf16, fp8 (e4m3), int8 and int4, behind one `Codec` interface.

    codec = get_codec("int8")                      # or get_codec_by_id(CodecId.INT8)
    enc = codec.encode(keys, Kind.KEY)             # keys: [n_blocks, block_size, kv_heads, head_dim]
    parts = enc.payload_view(), enc.scales_view(), enc.zeros_view()   # zero-copy bytes for the wire
    ...
    enc = from_buffer(codec_id, kind, shape, payload, scales, zeros)  # receiver: lengths checked
    get_codec_by_id(enc.codec_id).decode_into(enc, cache_slice)

Codec modules are imported on first lookup; see registry.py.
"""

from __future__ import annotations

from kvtransfer.codecs.base import Codec
from kvtransfer.codecs.encoded import CodecError, CodecId, EncodedTensor, Kind, WireLayout
from kvtransfer.codecs.registry import available_codecs, get_codec, get_codec_by_id

__all__ = [
    "Codec",
    "CodecError",
    "CodecId",
    "EncodedTensor",
    "Kind",
    "WireLayout",
    "available_codecs",
    "from_buffer",
    "get_codec",
    "get_codec_by_id",
]


def from_buffer(
    codec_id: CodecId | int,
    kind: Kind | str,
    shape: tuple[int, ...],
    payload: object,
    scales: object,
    zeros: object | None = None,
) -> EncodedTensor:
    """Rebuild a received tensor with the codec named by `codec_id`; see `Codec.from_buffer`."""
    return get_codec_by_id(codec_id).from_buffer(kind, shape, payload, scales, zeros)
