"""Encoding, checksumming and framing one KV chunk for a stream: the sender's costly per-chunk work, run on
its encoder threads (or, for a small chunk, the sending thread), several chunks at once.

``ChunkBuilder`` knows the stream's request, layout and transport, and the sender's pools; each build
returns a ``Built`` chunk ready to send in sequence order. Inputs: a snapshot of blocks (host or device
tensors, ``build``), or a chunk already encoded on the device from the paged cache (``build_staged``,
kvtransfer.device_chunks). Destinations: a message (gRPC, bulk TCP parts), a shared-memory segment, or a
mapped CUDA IPC segment; on the last two the message only says where the bytes are.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtransfer.checksum import chunk_checksum
from kvtransfer.chunks import (
    chunk_nbytes,
    encode_into_device_segment,
    encode_into_segment,
    frame_chunk,
    frame_chunk_into,
    frame_chunk_parts,
    writes_in_place,
)
from kvtransfer.codecs import Codec, CodecError
from kvtransfer.cuda_ipc import MappedSegment
from kvtransfer.device_chunks import DeviceChunk, to_device_checked, to_host_checked
from kvtransfer.layout import KVLayout
from kvtransfer.shm import SharedSegment
from kvtransfer.stream_context import StreamContext
from kvtransfer.wire import encode_chunk_parts, encode_control, pb

Segment = SharedSegment | MappedSegment | None


@dataclass(frozen=True)
class Built:
    """One chunk, encoded and framed on an encoder thread, waiting for its turn on the stream."""

    message: bytes | list  # what gRPC sends: the whole chunk, or (shared memory) only its header;
    # on the bulk TCP transport, the whole chunk as parts for sendmsg
    checksum: int
    nbytes: int  # scales + payload
    logical: int  # the same blocks in bf16
    buffer: torch.Tensor | None = None  # the pooled buffer ``message`` views (bulk TCP): given back once sent



class ChunkBuilder:
    """Builds one stream's chunks; thread-safe (it only reads its fields and takes pooled buffers)."""

    def __init__(self, ctx: StreamContext, request_id: str, layout: KVLayout, bulk: bool) -> None:
        self.ctx = ctx
        self.request_id = request_id
        self.layout = layout
        self.bulk = bulk  # the bulk TCP transport: chunks are sent as parts from pooled buffers

    def give_back(self, built: Built) -> None:
        """Return a sent chunk's buffer to the pool it came from (device chunks use pinned buffers)."""
        if built.buffer is not None:
            (self.ctx.pinned if built.buffer.is_pinned() else self.ctx.buffers).give(built.buffer)

    def build_at(self, layer: int, first_block: int, codec: Codec, key: torch.Tensor, value: torch.Tensor,
                 ready: torch.cuda.Event | None, seq: int, segment: Segment, offset: int) -> Built:
        return self._build(seq, layer, first_block, codec, key, value, segment, offset, ready)

    def build_staged(self, layer: int, first_block: int, staged: DeviceChunk, seq: int,
                      segment: Segment, offset: int) -> Built:
        """A chunk encoded on the device by ``send_blocks``: its bytes copied out, checked and framed."""
        try:
            return self._frame_staged(seq, layer, first_block, staged, segment, offset)
        except CodecError as exc:
            last = first_block + staged.num_blocks - 1
            raise CodecError(f"layer {layer}, blocks {first_block}..{last}: {exc}") from None

    def _frame_staged(self, seq: int, layer: int, first_block: int, staged: DeviceChunk,
                      segment: Segment, offset: int) -> Built:
        chunk = pb.KVChunk(seq=seq, request_id=self.request_id, layer=layer, first_block=first_block,
                           num_blocks=staged.num_blocks, codec=staged.codec.codec_id)  # type: ignore[arg-type]  # CodecId mirrors the proto Codec enum
        nbytes = staged.data.numel()
        logical = staged.num_blocks * self.layout.block_size * self.layout.num_kv_heads * self.layout.head_dim * 4
        if segment is None:
            on_device = staged.data.device.type != "cpu"
            buf = self.ctx.pinned.take(nbytes) if on_device else self.ctx.buffers.take(nbytes)
            to_host_checked(staged, buf[:nbytes])
            dest = buf.numpy().data[:nbytes]
            chunk.checksum = chunk_checksum([dest])
            s_len = staged.scales_nbytes
            parts = encode_chunk_parts(chunk, [dest[:s_len]], [dest[s_len:]])
            if self.bulk:
                return Built(parts, chunk.checksum, nbytes, logical, buf)  # sent from buf, then given back
            message = b"".join(parts)
            del parts, dest
            (self.ctx.pinned if on_device else self.ctx.buffers).give(buf)
            return Built(message, chunk.checksum, nbytes, logical)
        if isinstance(segment, MappedSegment):
            dest_t = segment.tensor[offset:offset + nbytes]
            chunk.checksum = to_device_checked(staged, dest_t)
        else:
            view = segment.view(offset, nbytes)
            to_host_checked(staged, torch.frombuffer(view, dtype=torch.uint8))
            chunk.checksum = chunk_checksum([view])
        chunk.shm.offset = offset
        chunk.shm.length = nbytes
        return Built(encode_control(pb.PushMessage(chunk=chunk)), chunk.checksum, nbytes, logical)

    def _build(self, seq: int, layer: int, first_block: int, codec: Codec, key: torch.Tensor,
               value: torch.Tensor, segment: Segment, offset: int, ready: torch.cuda.Event | None = None) -> Built:
        """Encode, checksum and frame one chunk. Runs on the sender's encoder threads, several chunks
        at once (torch, numpy, xxhash and the native kernels release the GIL), or on the sending
        thread for a small chunk; sent in ``seq`` order. A chunk that cannot be encoded (NaN in the
        cache) raises CodecError naming its layer and blocks."""
        try:
            return self._encode_chunk(seq, layer, first_block, codec, key, value, segment, offset, ready)
        except CodecError as exc:
            raise CodecError(f"layer {layer}, blocks {first_block}..{first_block + key.shape[0] - 1}: {exc}") from None

    def _encode_chunk(self, seq: int, layer: int, first_block: int, codec: Codec, key: torch.Tensor,
                      value: torch.Tensor, segment: Segment, offset: int,
                      ready: torch.cuda.Event | None = None) -> Built:
        chunk = pb.KVChunk(seq=seq, request_id=self.request_id, layer=layer, first_block=first_block,
                           num_blocks=key.shape[0], codec=int(codec.codec_id))  # type: ignore[arg-type]  # an int value of the proto Codec enum
        logical = key.numel() * 4
        if segment is None:
            on_host = key.device.type == "cpu"  # device input: encoded on the device, only its bytes come over
            if on_host and not writes_in_place(codec):  # bf16/fp32: the message's parts are views of the input
                framed, nbytes = (frame_chunk_parts if self.bulk else frame_chunk)(chunk, codec, key,
                                                                                                value)
                return Built(framed, chunk.checksum, nbytes, logical)
            size = chunk_nbytes(codec, tuple(key.shape))
            buf = self.ctx.buffers.take(size) if on_host else self.ctx.pinned.take(size)
            parts, nbytes = frame_chunk_into(chunk, codec, key, value, buf, ready)
            if self.bulk:
                return Built(parts, chunk.checksum, nbytes, logical, buf)  # sent from buf, then given back
            message = b"".join(parts)  # gRPC sends bytes: buf is free again once joined
            del parts
            (self.ctx.buffers if on_host else self.ctx.pinned).give(buf)
            return Built(message, chunk.checksum, nbytes, logical)
        # Shared memory or a CUDA IPC segment: encoded straight into it; the message only says where.
        nbytes = chunk_nbytes(codec, tuple(key.shape))
        if isinstance(segment, MappedSegment):
            encode_into_device_segment(chunk, codec, key, value, segment.tensor[offset:offset + nbytes], ready)
        else:
            encode_into_segment(chunk, codec, key, value, segment.view(offset, nbytes), ready)
        chunk.shm.offset = offset
        chunk.shm.length = nbytes
        return Built(encode_control(pb.PushMessage(chunk=chunk)), chunk.checksum, nbytes, logical)
