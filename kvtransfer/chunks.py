"""Encoding one KV chunk for the wire: the sender's costly per-chunk work, run on its encoder threads.

A chunk is the keys and values of some blocks of one layer. Its bulk bytes are the keys' scales
(and zero points), the values', then the keys' payload and the values' (see wire.py), checksummed
with xxh3 in that order. Two destinations:
  - gRPC: ``frame_chunk`` builds the whole PushMessage as one ``bytes`` (grpcio sends only bytes);
    the bulk TCP transport sends the same message's parts with ``sendmsg`` (``frame_chunk_parts``);
  - shared memory: ``encode_into_segment`` encodes straight into the chunk's range of the segment.
For codecs without scales (bf16, fp32) both work a 1 MiB piece at a time and hash each piece right
after encoding it, while it is still in the core's cache: the input is read from memory once.
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvtransfer.checksum import ChunkHasher, chunk_checksum
from kvtransfer.codecs import Codec, EncodedTensor, Kind
from kvtransfer.device_checksum import device_checksum
from kvtransfer.staging import side_stream, to_host
from kvtransfer.wire import encode_chunk_parts, pb

_NUMPY_FLOATS = {torch.float32: np.float32, torch.float16: np.float16}
PIECE_BYTES = 1 << 20  # input bytes per encode-then-hash step: well inside a core's L2


def chunk_nbytes(codec: Codec, shape: tuple[int, ...]) -> int:
    """Scales + payload bytes of a chunk of ``shape`` (keys and values)."""
    return codec.layout(shape, Kind.KEY).total_nbytes + codec.layout(shape, Kind.VALUE).total_nbytes


def frame_chunk(chunk: pb.KVChunk, codec: Codec, key: torch.Tensor, value: torch.Tensor) -> tuple[bytes, int]:
    """Encode ``key``/``value``, set ``chunk.checksum``; returns the framed PushMessage and its bulk bytes.

    (Encoding straight into a preallocated message instead of joining parts saves only a small share of a
    push, and nothing for bf16: not worth building bytes in place.)"""
    parts, nbytes = frame_chunk_parts(chunk, codec, key, value)
    return b"".join(parts), nbytes


def frame_chunk_parts(chunk: pb.KVChunk, codec: Codec, key: torch.Tensor,
                      value: torch.Tensor) -> tuple[list[bytes | memoryview], int]:
    """``frame_chunk`` without the final join: the message as parts, for the bulk TCP transport's
    ``sendmsg`` (the parts are views of the encoded tensors, kept alive by the list)."""
    if _sizes(codec, tuple(key.shape))[0] == 0:
        scales: list[memoryview] = []
        payload, chunk.checksum = _encode_hashed(codec, key, value)
    else:
        k, v = codec.encode(key, Kind.KEY), codec.encode(value, Kind.VALUE)
        scales = scale_views(k, v)
        payload = [k.payload_view(), v.payload_view()]
        chunk.checksum = chunk_checksum([*scales, *payload])
    nbytes = sum(m.nbytes for m in scales) + sum(m.nbytes for m in payload)
    return encode_chunk_parts(chunk, scales, payload), nbytes


def frame_chunk_into(chunk: pb.KVChunk, codec: Codec, key: torch.Tensor, value: torch.Tensor,
                     buf: torch.Tensor, ready: torch.cuda.Event | None = None) -> tuple[list[bytes | memoryview], int]:
    """``frame_chunk_parts`` with the scales and payload encoded into ``buf`` (1-D uint8, at least
    ``chunk_nbytes`` long; a pooled buffer), for codecs that encode straight into a destination
    (``writes_in_place``), and for every codec when the input is on a device (encoded there, then
    only its bytes copied into ``buf``, pinned; ``ready`` as in ``_encode_on_device``). The parts
    are views of ``buf``: reuse it only once they are sent."""
    nbytes = chunk_nbytes(codec, tuple(key.shape))
    dest = buf.numpy().data[:nbytes]
    s_len, k_len, _ = _sizes(codec, tuple(key.shape))
    if key.device.type != "cpu":
        chunk.checksum = _encode_on_device(codec, key, value, buf[:nbytes], dest, s_len, k_len, ready)
    else:
        chunk.checksum = _encode_into_parts(codec, key, value, dest[:s_len], dest[s_len:], k_len)
    return encode_chunk_parts(chunk, [dest[:s_len]], [dest[s_len:]]), nbytes


@functools.cache  # asked once per chunk on the sender; codecs are singletons
def writes_in_place(codec: Codec) -> bool:
    """True for a codec with scales whose ``encode_into`` writes the payload where it is told (no
    temporary): encoding it into a pooled buffer saves a fresh allocation per chunk. Scale-free
    codecs (bf16, fp32) send views of their input instead, with no copy at all."""
    if type(codec)._encode_into is Codec._encode_into:
        return False
    try:
        return _sizes(codec, (1, 32, 2, 64))[0] > 0  # a shape every codec accepts (int4: even dims, groups of 32)
    except ValueError:  # CodecError: a codec with other constraints; the plain path serves it
        return False


def non_finite_values(codec_name: str, scales_dtype: torch.dtype, scales: memoryview,
                      payload: memoryview) -> str | None:
    """What is non-finite in a received chunk's values, or None: NaN/inf in its scales (and zero
    points), or a NaN byte in an fp8 payload (e4m3 has no inf). The sender refuses to encode such a
    cache, and checksums only prove the bytes arrived as sent, so this guards against a sender that
    is wrong: one NaN that lands in the decode cache poisons every later step of that request (only
    that one: blocks are not shared between requests, and the sampler keeps a non-finite row from failing
    its batch). Costs a pass over the (small) scales, and over fp8 payloads. Integer payloads (int8,
    int4) cannot hold one; float payloads (bf16, fp32) are not checked here (a full pass over the largest
    payloads; the sender checks them)."""
    if scales.nbytes:
        np_dtype = _NUMPY_FLOATS.get(scales_dtype)
        finite = (np.isfinite(np.frombuffer(scales, dtype=np_dtype)).all() if np_dtype is not None else
                  torch.isfinite(torch.frombuffer(bytearray(scales), dtype=scales_dtype)).all())
        if not bool(finite):
            return "its scales hold NaN or inf"
    if codec_name == "fp8" and payload.nbytes:
        raw = np.frombuffer(payload, dtype=np.uint8)
        if np.any((raw & 0x7F) == 0x7F):  # S.1111.111: e4m3fn's only NaN pattern
            return "its fp8 payload holds NaN"
    return None


def encode_into_segment(chunk: pb.KVChunk, codec: Codec, key: torch.Tensor, value: torch.Tensor,
                        dest: memoryview, ready: torch.cuda.Event | None = None) -> None:
    """Encode into ``dest`` (exactly ``chunk_nbytes`` long, writable) and set ``chunk.checksum``."""
    s_len, k_len, _ = _sizes(codec, tuple(key.shape))
    if key.device.type != "cpu":
        host = torch.frombuffer(dest, dtype=torch.uint8)
        chunk.checksum = _encode_on_device(codec, key, value, host, dest, s_len, k_len, ready)
        return
    chunk.checksum = _encode_into_parts(codec, key, value, dest[:s_len], dest[s_len:], k_len)


def _sizes(codec: Codec, shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(scales + zeros of both, keys' payload, values' payload) bytes."""
    k_lay, v_lay = codec.layout(shape, Kind.KEY), codec.layout(shape, Kind.VALUE)
    s_len = k_lay.scale_nbytes + k_lay.zero_nbytes + v_lay.scale_nbytes + v_lay.zero_nbytes
    return s_len, k_lay.payload_nbytes, v_lay.payload_nbytes


def _encode_into_parts(codec: Codec, key: torch.Tensor, value: torch.Tensor, scales: memoryview,
                       payload: memoryview, k_len: int) -> int:
    """Encode into the two writable regions (scales and zeros; then keys' and values' payload) and
    return the chunk's checksum over both."""
    out = torch.frombuffer(payload, dtype=torch.uint8) if payload.nbytes else torch.empty(0, dtype=torch.uint8)
    if scales.nbytes == 0:
        return _encode_into_hashed(codec, key, value, out, payload)
    k = codec.encode_into(key, Kind.KEY, out[:k_len])
    v = codec.encode_into(value, Kind.VALUE, out[k_len:])
    pos = 0
    for m in scale_views(k, v):
        scales[pos:pos + m.nbytes] = m
        pos += m.nbytes
    return chunk_checksum([scales, payload])


def _encode_on_device(codec: Codec, key: torch.Tensor, value: torch.Tensor, host: torch.Tensor, dest: memoryview,
                      s_len: int, k_len: int, ready: torch.cuda.Event | None = None) -> int:
    """Encode device tensors into a device buffer laid out as the wire's bulk bytes (scales and zeros,
    then the keys' and values' payload), copy only those bytes to ``host`` (pinned for an asynchronous
    copy; ``dest`` is its byte view) on the side stream, and return the checksum over the host bytes.
    ``ready``: an event the side stream waits for (the snapshot's copy); None: the current stream."""
    with side_stream(key.device, ready):
        dev = torch.empty(host.numel(), dtype=torch.uint8, device=key.device)
        _encode_parts_to(codec, key, value, dev, s_len, k_len)
        to_host(dev, host)
    return chunk_checksum([dest])


def encode_into_device_segment(chunk: pb.KVChunk, codec: Codec, key: torch.Tensor, value: torch.Tensor,
                               dest: torch.Tensor, ready: torch.cuda.Event | None = None) -> None:
    """TRANSPORT_CUDA_IPC: encode into ``dest`` (1-D uint8 of ``chunk_nbytes``, in the receiver's device
    memory, mapped here) and set ``chunk.checksum`` to its ``device_checksum``. Returns once the bytes
    are in place (the receiver reads them when the chunk's control message arrives)."""
    s_len, k_len, _ = _sizes(codec, tuple(key.shape))
    work = key.device if key.device.type == "cuda" else dest.device
    with side_stream(work, ready):
        if key.device == dest.device:
            _encode_parts_to(codec, key, value, dest, s_len, k_len)
            chunk.checksum = device_checksum(dest)
        else:  # another device (or the host): encode where the input is, then one copy
            local = torch.empty(dest.numel(), dtype=torch.uint8, device=key.device)
            _encode_parts_to(codec, key, value, local, s_len, k_len)
            dest.copy_(local)
            # summed on the stream that did the work: the local bytes on another GPU, else what landed
            chunk.checksum = device_checksum(local if work == key.device else dest)


def _encode_parts_to(codec: Codec, key: torch.Tensor, value: torch.Tensor, dev: torch.Tensor, s_len: int,
                     k_len: int) -> None:
    """Encode into ``dev`` (1-D uint8 on the input's device) in the wire's order: scales and zeros, then
    the keys' and values' payload."""
    k = codec.encode_into(key, Kind.KEY, dev[s_len:s_len + k_len])
    v = codec.encode_into(value, Kind.VALUE, dev[s_len + k_len:])
    pos = 0
    for t in (k.scales, k.zeros, v.scales, v.zeros):
        if t is not None and t.numel():
            n = t.numel() * t.element_size()
            dev[pos:pos + n].copy_(t.reshape(-1).view(torch.uint8))
            pos += n


def scale_views(k: EncodedTensor, v: EncodedTensor) -> list[memoryview]:
    """Keys' scales and zeros, then values', as the wire orders them (empty parts left out)."""
    return [m for m in (k.scales_view(), k.zeros_view(), v.scales_view(), v.zeros_view())
            if m is not None and m.nbytes]


def _blocks_per_piece(key: torch.Tensor) -> int:
    return max(1, PIECE_BYTES // max(1, key[0].nbytes))


def _encode_hashed(codec: Codec, key: torch.Tensor, value: torch.Tensor) -> tuple[list[memoryview], int]:
    """A scale-free codec encoded a few blocks at a time, each piece's payload hashed right away."""
    per = _blocks_per_piece(key)
    hasher = ChunkHasher()
    views = []
    for tensor, kind in ((key, Kind.KEY), (value, Kind.VALUE)):
        for i in range(0, tensor.shape[0], per):
            view = codec.encode(tensor[i:i + per], kind).payload_view()
            hasher.update(view)
            views.append(view)
    return views, hasher.value


def _encode_into_hashed(codec: Codec, key: torch.Tensor, value: torch.Tensor, out: torch.Tensor,
                        dest: memoryview) -> int:
    """A scale-free codec, encoded into ``out``/``dest`` (two views of the same bytes) a few blocks at
    a time, each piece hashed right after it was written."""
    per = _blocks_per_piece(key)
    hasher = ChunkHasher()
    pos = 0
    for tensor, kind in ((key, Kind.KEY), (value, Kind.VALUE)):
        for i in range(0, tensor.shape[0], per):
            part = tensor[i:i + per]
            n = codec.layout(tuple(part.shape), kind).payload_nbytes
            codec.encode_into(part, kind, out[pos:pos + n])
            hasher.update(dest[pos:pos + n])
            pos += n
    return hasher.value
