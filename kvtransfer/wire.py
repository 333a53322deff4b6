"""The wire: generated protobuf messages plus zero-copy framing for the bulk fields.

Every message on the wire is a protobuf message of proto/epd/kvtransfer/v1. Chunks are large, so
they are written and read without building a protobuf object around the bytes: the sender
serialises the small header fields with protobuf and appends the ``scales`` and ``payload``
fields (tags 14 and 15) itself, which is the same byte string protobuf would produce; the receiver
walks the fields, parses the header with protobuf and keeps the bulk fields as memoryviews into
the received buffer. Any other valid encoding of the same message (fields in another order, from
another implementation) is read too.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

try:
    from epd.kvtransfer.v1 import kvtransfer_pb2 as pb
except ImportError as exc:  # pragma: no cover - only without `make setup`
    raise ImportError("epd's generated protobuf code is missing: run `make setup` "
                      "(it runs grpc_tools.protoc over proto/)") from exc

SERVICE = "epd.kvtransfer.v1.KVTransfer"
PUSH_METHOD = f"/{SERVICE}/Push"
PUSH_EMBEDDINGS_METHOD = f"/{SERVICE}/PushEmbeddings"
OPEN_BULK_METHOD = f"/{SERVICE}/OpenBulk"
OPEN_CUDA_IPC_METHOD = f"/{SERVICE}/OpenCudaIpc"
PROTOCOL_VERSION = 1

# A push's first token's log-probability and the most likely tokens' (id, log-probability), most likely first:
# what PushFinish's first_logprob, first_top_ids and first_top_logprobs carry.
FirstLogprobs = tuple[float, tuple[tuple[int, float], ...]]

_HANDSHAKE, _CHUNK, _FINISH = 1, 2, 3  # oneof field numbers, the same in PushMessage and EmbeddingMessage
SCALES_FIELD, PAYLOAD_FIELD = 14, 15
_LEN = 2  # wire type: length-delimited
_EMPTY = memoryview(b"")


class WireError(ValueError):
    """A message that is not a valid encoding of the expected protobuf message."""


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        byte = n & 0x7F
        n >>= 7
        if n:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _len_prefix(field: int, nbytes: int) -> bytes:
    return _varint(field << 3 | _LEN) + _varint(nbytes)


def _read_varint(buf: memoryview, pos: int) -> tuple[int, int]:
    result = shift = 0
    end = len(buf)
    while True:
        if pos >= end or shift > 63:
            raise WireError("truncated or overlong varint")
        byte = buf[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return result, pos
        shift += 7


def _fields(buf: memoryview) -> Iterable[tuple[int, int, int, int, int]]:
    """(field number, wire type, key start, value start, end) of each field of a message."""
    pos = 0
    end = len(buf)
    while pos < end:
        key_start = pos
        key, pos = _read_varint(buf, pos)
        field, wtype = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        value_start = pos
        if wtype == 0:
            _, pos = _read_varint(buf, pos)
        elif wtype == 1:
            pos += 8
        elif wtype == 5:
            pos += 4
        elif wtype == _LEN:
            length, value_start = _read_varint(buf, pos)
            pos = value_start + length
        else:
            raise WireError(f"unsupported wire type {wtype}")
        if pos > end:
            raise WireError("a field runs past the end of the message")
        yield field, wtype, key_start, value_start, pos


# ------------------------------------------------------------------ sending
def encode_chunk(chunk: pb.KVChunk | pb.EmbeddingChunk, scales: Iterable[memoryview],
                 payload: Iterable[memoryview]) -> bytes:
    """PushMessage/EmbeddingMessage{chunk: <chunk with scales and payload>} as bytes, built with
    one copy of the bulk data. ``chunk`` must leave its scales/payload fields unset."""
    return b"".join(encode_chunk_parts(chunk, scales, payload))


def encode_chunk_parts(chunk: pb.KVChunk | pb.EmbeddingChunk, scales: Iterable[memoryview],
                       payload: Iterable[memoryview]) -> list[bytes | memoryview]:
    """The same message as ``encode_chunk``, as the parts that concatenate to it (no copy of the bulk
    data), for a writer that can send a list of buffers (``socket.sendmsg``)."""
    head = chunk.SerializeToString()
    scales, payload = list(scales), list(payload)
    s_len = sum(m.nbytes for m in scales)
    p_len = sum(m.nbytes for m in payload)
    parts: list[bytes | memoryview] = [head]
    if s_len:
        parts += [_len_prefix(SCALES_FIELD, s_len), *scales]
    if p_len:  # proto3 omits an empty bytes field; so must we, to stay byte-identical
        parts += [_len_prefix(PAYLOAD_FIELD, p_len), *payload]
    body_len = sum(len(p) if isinstance(p, bytes) else p.nbytes for p in parts)
    return [_len_prefix(_CHUNK, body_len), *parts]


def encode_control(msg: pb.PushMessage | pb.EmbeddingMessage) -> bytes:
    return msg.SerializeToString()


# ------------------------------------------------------------------ receiving
@dataclass(frozen=True)
class Frame:
    """One received stream message. For a chunk, ``header`` is the chunk without its bulk fields."""

    kind: str  # "handshake" | "chunk" | "finish"
    header: Any  # the handshake, chunk or finish message (protobuf), by ``kind``
    scales: memoryview = _EMPTY
    payload: memoryview = _EMPTY


def decode_frame(data: bytes | memoryview, outer: Any, chunk_type: Any) -> Frame:
    """Split a PushMessage/EmbeddingMessage into its parts; raises WireError naming the problem."""
    buf = memoryview(data)
    found: list[tuple[int, int, int]] = []
    for field, wtype, _, start, end in _fields(buf):
        if field in (_HANDSHAKE, _CHUNK, _FINISH):
            if wtype != _LEN:
                raise WireError(f"field {field} must be length-delimited")
            found.append((field, start, end))
        # unknown fields are skipped, as protobuf does
    if len(found) != 1:
        raise WireError(f"expected exactly one of handshake, chunk or finish; got {len(found)} fields")
    field, start, end = found[0]
    if field != _CHUNK:
        try:
            msg = outer.FromString(bytes(buf))
        except Exception as exc:  # protobuf's DecodeError
            raise WireError(f"malformed message: {exc}") from None
        kind = "handshake" if field == _HANDSHAKE else "finish"
        return Frame(kind, getattr(msg, kind))
    inner = buf[start:end]
    header_parts: list[memoryview] = []
    bulk: dict[int, memoryview] = {}
    for f, wtype, key_start, s, e in _fields(inner):
        if f in (SCALES_FIELD, PAYLOAD_FIELD):
            if wtype != _LEN or f in bulk:
                raise WireError(f"field {f} must appear once, length-delimited")
            bulk[f] = inner[s:e]
        else:
            header_parts.append(inner[key_start:e])  # the whole field, key included, for protobuf
    try:
        header = chunk_type.FromString(b"".join(header_parts))
    except Exception as exc:
        raise WireError(f"malformed chunk header: {exc}") from None
    return Frame("chunk", header, bulk.get(SCALES_FIELD, _EMPTY), bulk.get(PAYLOAD_FIELD, _EMPTY))
