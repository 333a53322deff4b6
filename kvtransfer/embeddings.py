"""Image embeddings from an encode worker to a prefill worker, on the same machinery as KV:
handshake (request id, hidden size, rows, dtype, encoder fingerprint), checked chunks of rows,
finish with totals. The prefill side ``expect``s a request's rows before the encoder pushes them;
``on_done`` gets the [rows, hidden] tensor, or the error.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.checksum import StreamChecksum, chunk_checksum
from kvtransfer.errors import TransferFailed, TransferRefused
from kvtransfer.expectations import Expectations, run_stream
from kvtransfer.wire import (
    PROTOCOL_VERSION,
    PUSH_EMBEDDINGS_METHOD,
    SERVICE,
    Frame,
    WireError,
    decode_frame,
    encode_chunk,
    encode_control,
    pb,
)

Code = grpc.StatusCode
_DTYPES = {pb.DTYPE_FLOAT32: torch.float32, pb.DTYPE_BFLOAT16: torch.bfloat16}
_DTYPE_IDS = {v: k for k, v in _DTYPES.items()}


@dataclass(frozen=True)
class EmbeddingOutcome:
    request_id: str
    ok: bool
    embeds: torch.Tensor | None = None
    code: grpc.StatusCode | None = None
    error: str | None = None


@dataclass(eq=False)
class _Target:
    num_rows: int
    buffer: torch.Tensor | None = None
    covered: bytearray | None = None


class EmbeddingReceiver:
    def __init__(self, hidden_size: int, fingerprint: str, *, max_rows: int = 65536,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.hidden_size = hidden_size
        self.fingerprint = fingerprint
        self.max_rows = max_rows
        self.expectations: Expectations[EmbeddingOutcome] = Expectations(
            lambda rid, err: EmbeddingOutcome(rid, False, code=err.code, error=err.message), clock)

    def expect(self, request_id: str, num_rows: int, on_done: Callable[[EmbeddingOutcome], None],
               timeout_s: float) -> None:
        if not 0 < num_rows <= self.max_rows:
            raise ValueError(f"num_rows must be in [1, {self.max_rows}], got {num_rows}")
        self.expectations.add(request_id, _Target(num_rows), on_done, timeout_s)

    def cancel(self, request_id: str, reason: str = "cancelled by the receiver") -> bool:
        return self.expectations.cancel(request_id, reason)

    @property
    def pending(self) -> int:
        return len(self.expectations)

    def push(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        return run_stream(self.expectations, context, lambda bound: self._run(requests, bound, context))

    def _run(self, requests: Iterator[bytes], bound: list, context: grpc.ServicerContext) -> bytes:
        frames = (_decode(d) for d in requests)
        first = next(frames, None)
        if first is None or first.kind != "handshake":
            raise TransferRefused(Code.INVALID_ARGUMENT, "a PushEmbeddings stream must open with a handshake")
        hs: pb.EmbeddingHandshake = first.header
        exp = self.expectations.claim(hs.request_id, wake=lambda _: context.cancel())  # expired, cancelled
        bound.append(exp)
        target: _Target = exp.target
        if hs.protocol_version != PROTOCOL_VERSION:
            raise TransferRefused(Code.FAILED_PRECONDITION, f"protocol version {hs.protocol_version} unsupported")
        if hs.hidden_size != self.hidden_size or hs.model_fingerprint != self.fingerprint:
            raise TransferRefused(Code.FAILED_PRECONDITION,
                                  f"embedding layout mismatch: sender hidden {hs.hidden_size} / encoder "
                                  f"{hs.model_fingerprint!r}, receiver {self.hidden_size} / {self.fingerprint!r}")
        if hs.num_embeddings != target.num_rows:
            raise TransferRefused(Code.OUT_OF_RANGE, f"{hs.num_embeddings} rows announced, {target.num_rows} expected")
        if hs.dtype not in _DTYPES:
            raise TransferRefused(Code.INVALID_ARGUMENT, f"unsupported embedding dtype {hs.dtype}")
        dtype = _DTYPES[hs.dtype]
        target.buffer = torch.empty(target.num_rows, self.hidden_size, dtype=dtype)
        target.covered = bytearray(target.num_rows)
        row_bytes = self.hidden_size * dtype.itemsize
        seq = total = 0
        checksum = StreamChecksum()
        for frame in frames:
            if frame.kind == "finish":
                f: pb.EmbeddingFinish = frame.header
                if f.num_chunks != seq or f.num_bytes != total or f.checksum != checksum.value:
                    raise TransferRefused(Code.DATA_LOSS, "finish totals disagree with what arrived")
                if target.covered.count(0):
                    raise TransferRefused(Code.DATA_LOSS, f"truncated transfer: {target.covered.count(0)} rows missing")
                self.expectations.complete(exp, EmbeddingOutcome(exp.request_id, True, target.buffer))
                return pb.EmbeddingAck(request_id=exp.request_id, num_chunks=seq, num_bytes=total,
                                       checksum=checksum.value).SerializeToString()
            if frame.kind != "chunk":
                raise TransferRefused(Code.INVALID_ARGUMENT, "a second handshake on the same stream")
            c: pb.EmbeddingChunk = frame.header
            if c.seq != seq:
                raise TransferRefused(Code.INVALID_ARGUMENT, f"chunk out of order or duplicated: expected seq {seq}, "
                                                             f"got {c.seq}")
            if c.num_rows == 0 or c.first_row + c.num_rows > target.num_rows:
                raise TransferRefused(Code.OUT_OF_RANGE, f"rows {c.first_row}..{c.first_row + c.num_rows - 1} "
                                                         f"outside the request's {target.num_rows}")
            if frame.payload.nbytes != c.num_rows * row_bytes:
                raise TransferRefused(Code.INVALID_ARGUMENT, f"chunk carries {frame.payload.nbytes} bytes, expected "
                                                             f"{c.num_rows * row_bytes}")
            if chunk_checksum((frame.payload,)) != c.checksum:
                raise TransferRefused(Code.DATA_LOSS, f"chunk seq {c.seq}: checksum mismatch")
            if any(target.covered[c.first_row:c.first_row + c.num_rows]):
                raise TransferRefused(Code.INVALID_ARGUMENT, f"chunk seq {c.seq} overlaps rows already received")
            dest = target.buffer[c.first_row:c.first_row + c.num_rows].view(torch.uint8).numpy()
            np.copyto(dest.reshape(-1), np.frombuffer(frame.payload, dtype=np.uint8))
            target.covered[c.first_row:c.first_row + c.num_rows] = b"\x01" * c.num_rows
            seq += 1
            total += frame.payload.nbytes
            checksum.add(c.checksum)
        raise TransferRefused(Code.DATA_LOSS, "the stream ended before its finish message (sender gone?)")


def _decode(data: bytes) -> Frame:
    try:
        return decode_frame(data, pb.EmbeddingMessage, pb.EmbeddingChunk)
    except WireError as exc:
        raise TransferRefused(Code.INVALID_ARGUMENT, f"malformed message: {exc}") from None


def embedding_handler(receiver: EmbeddingReceiver) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "PushEmbeddings": grpc.stream_unary_rpc_method_handler(receiver.push),
    })


def push_embeddings(channel: grpc.Channel, security: TransferSecurity, request_id: str, embeds: torch.Tensor,
                    fingerprint: str, timeout_s: float = 30.0, max_chunk_bytes: int = 4 * 2**20) -> int:
    """Send ``embeds`` [rows, hidden] (float32 or bf16) for ``request_id``; returns bytes sent."""
    if embeds.dtype not in _DTYPE_IDS or embeds.dim() != 2:
        raise ValueError(f"embeddings must be a 2-D float32/bfloat16 tensor, got {embeds.dtype} {tuple(embeds.shape)}")
    embeds = embeds.detach().to("cpu").contiguous()
    rows, hidden = embeds.shape
    per_chunk = max(1, max_chunk_bytes // max(1, hidden * embeds.dtype.itemsize))
    sums = StreamChecksum()
    sent = [0, 0]

    def messages() -> Iterator[bytes]:
        yield encode_control(pb.EmbeddingMessage(handshake=pb.EmbeddingHandshake(
            protocol_version=PROTOCOL_VERSION, request_id=request_id, hidden_size=hidden, num_embeddings=rows,
            dtype=_DTYPE_IDS[embeds.dtype], model_fingerprint=fingerprint)))
        for seq, first in enumerate(range(0, rows, per_chunk)):
            part = embeds[first:first + per_chunk]
            view = part.view(torch.uint8).numpy().data.cast("B")
            checksum = chunk_checksum((view,))
            sums.add(checksum)
            sent[0] += 1
            sent[1] += view.nbytes
            yield encode_chunk(pb.EmbeddingChunk(seq=seq, first_row=first, num_rows=part.shape[0],
                                                 checksum=checksum), (), (view,))
        yield encode_control(pb.EmbeddingMessage(finish=pb.EmbeddingFinish(
            num_chunks=sent[0], num_bytes=sent[1], checksum=sums.value)))

    call: Any = channel.stream_unary(PUSH_EMBEDDINGS_METHOD, request_serializer=None,
                                response_deserializer=pb.EmbeddingAck.FromString)
    try:
        ack = call(messages(), timeout=timeout_s, metadata=security.call_metadata())
    except grpc.RpcError as exc:
        raise TransferFailed(f"receiver refused the embeddings: {exc.details()}", exc.code()) from None
    if ack.num_bytes != sent[1] or ack.checksum != sums.value:
        raise TransferFailed("receiver acknowledged different totals", Code.DATA_LOSS)
    return sent[1]
