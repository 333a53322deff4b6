"""One KV push from the sending end (runs on the prefill worker), opened by ``KVSender.open_stream``.

A stream's life on this side:
  1. ``KVSender.open_stream`` picks the transport (shared memory on the same host, else gRPC
     bytes; or the bulk TCP connection when configured, see kvtransfer.bulk), opens the Push call
     with a deadline and queues the handshake. A shared-memory push sends its control messages
     (handshake, chunk offsets, finish) over the bulk TCP connection too when the receiver has one,
     and over the gRPC Push stream otherwise.
  2. ``send_layer`` is called as prefill finishes a layer's blocks (the engine's layer hook), with
     a snapshot of those blocks. It only numbers and queues chunks: the sender's encoder threads
     encode, checksum and frame several chunks at once while the next layer computes (on shared
     memory, encoding straight into the segment), and one sending thread only sends the framed
     chunks in order: gRPC's, or on the TCP transport a writer thread that writes the whole push (the
     handshake, chunks and finish) to the bulk connection, with no gRPC call. A small chunk
     (``inline_build_bytes``) is encoded by the sending thread itself when its turn comes: its
     hand-off would cost more than the work. Queued bytes are bounded per stream and per sender,
     so a slow receiver slows prefill down instead of filling memory.
  3. ``finish`` queues the totals and the first token and waits for the receiver's ack (on the TCP
     transport, its PushResult, read by ``kvtransfer.bulk_call.BulkCall``).
  Any failure (refusal, deadline, cancel, receiver gone) fails the stream: later calls raise
  ``TransferFailed`` with the receiver's status and message, and queued data is dropped.
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import torch
from google.protobuf.message import DecodeError

from kvtransfer.budget import ByteBudget
from kvtransfer.bulk import (
    KIND_CHUNK,
    KIND_FINISH,
    KIND_HANDSHAKE,
    KIND_LEASE,
    KIND_LEASE_RESULT,
    BulkConnection,
    BulkError,
)
from kvtransfer.bulk_call import BulkCall
from kvtransfer.checksum import StreamChecksum
from kvtransfer.chunk_builder import Built, ChunkBuilder
from kvtransfer.chunks import chunk_nbytes
from kvtransfer.codecs import Codec, CodecError, get_codec
from kvtransfer.cuda_ipc import IPC_ALIGNMENT, IpcError, MappedSegment, lease_request
from kvtransfer.device_chunks import CacheBlocks, block_nbytes, encode_from_cache
from kvtransfer.errors import ShmUnusable, TransferFailed, fresh, status_code
from kvtransfer.layout import KVLayout
from kvtransfer.reused_threads import ReusedThreads
from kvtransfer.shm import SharedSegment, ShmError
from kvtransfer.staging import wait_for_current
from kvtransfer.stream_context import StreamContext
from kvtransfer.wire import (
    OPEN_BULK_METHOD,
    OPEN_CUDA_IPC_METHOD,
    PROTOCOL_VERSION,
    PUSH_METHOD,
    FirstLogprobs,
    encode_control,
    pb,
)

_BULK_WRITERS = ReusedThreads("kv-bulk-write")  # one per bulk TCP stream while it sends


def finish_message(num_chunks: int, num_bytes: int, checksum: int, first_token: int,
                   first_logprobs: FirstLogprobs | None) -> pb.PushFinish:
    msg = pb.PushFinish(num_chunks=num_chunks, num_bytes=num_bytes, checksum=checksum, first_token=first_token)
    if first_logprobs is not None:
        msg.first_logprob = first_logprobs[0]
        msg.first_top_ids.extend(i for i, _ in first_logprobs[1])
        msg.first_top_logprobs.extend(v for _, v in first_logprobs[1])
    return msg


@dataclass(frozen=True)
class PushResult:
    request_id: str
    num_chunks: int
    num_bytes: int  # scales + payload bytes moved
    logical_bytes: int  # the same blocks in bf16, for throughput figures
    transport: str
    seconds: float


class KVStream:
    def __init__(self, ctx: StreamContext, target: str, request_id: str, layout: KVLayout, num_tokens: int,
                 timeout_s: float, transport: str, cached_blocks: int = 0) -> None:
        """``cached_blocks``: blocks [0, cached_blocks) the receiver holds already (its prefix cache, as its
        Holds reply said): never sent, and said in the handshake."""
        self.ctx = ctx
        self.request_id = request_id
        self.layout = layout
        self.num_tokens = num_tokens
        self.num_blocks = layout.blocks_for(num_tokens)
        if not 0 <= cached_blocks < self.num_blocks:
            raise ValueError(f"cached_blocks must be in [0, {self.num_blocks}) for {num_tokens} tokens, "
                             f"got {cached_blocks}")
        self.cached_blocks = cached_blocks
        self.transport = transport
        self.started = time.monotonic()
        self.deadline = self.started + timeout_s
        self._queue: queue.Queue = queue.Queue()
        self._failed = threading.Event()
        self._error: TransferFailed | None = None
        self._finished = False
        self._budget = ByteBudget(ctx.sizes.stream_budget)
        self._seq = 0  # chunks handed to gRPC
        self._submitted = 0  # chunks numbered (their seq) and queued, in queue order
        self._order = threading.Lock()
        self._bytes = 0
        self._logical = 0
        self._checksum = StreamChecksum()
        self._segment: SharedSegment | MappedSegment | None = None
        self._shm_offset = 0
        self._bulk: BulkConnection | None = None
        self._bulk_settled = False
        self._written: threading.Event | None = None  # under TLS: set when the writer is done (BulkCall reads after)
        self.target = target
        hs = pb.PushHandshake(protocol_version=PROTOCOL_VERSION, request_id=request_id, layout=layout.to_proto(),
                              num_tokens=num_tokens, transport=pb.TRANSPORT_GRPC, sender_host=ctx.host,
                              cached_blocks=cached_blocks)
        if transport == "shm":
            try:
                self._segment = ctx.segments.take(self._segment_size())
            except ShmError as exc:
                raise ShmUnusable(f"cannot use shared memory: {exc}", exc.lasting) from None
            hs.transport = pb.TRANSPORT_SHARED_MEMORY
            hs.shm_name = self._segment.name
            hs.shm_size = self._segment.size
            # Its control messages go over the bulk connection when the receiver has one: a gRPC stream
            # per push costs more than a small push's data, and each message would cross grpcio's
            # threads on both sides (arriving late under load).
            self._bulk = self._control_connection(target, timeout_s)
        elif transport == "tcp":
            self._bulk = self._open_bulk(target, timeout_s)
            hs.transport = pb.TRANSPORT_TCP
        elif transport == "cuda_ipc":  # the chunks' bytes go device to device; control as for shm
            self._bulk = self._control_connection(target, timeout_s)
            try:
                self._segment = self._lease_ipc(target, timeout_s)  # on that connection when there is one
            except TransferFailed:
                if self._bulk is not None:  # refused, or not mappable here: the connection is clean, reusable
                    self._bulk.unbind()
                    self.ctx.bulk.give(target, self._bulk)
                raise
            hs.transport = pb.TRANSPORT_CUDA_IPC
            hs.ipc_epoch = self._segment.epoch
            hs.ipc_segment = self._segment.index
        if self._bulk is not None:
            self._bulk.bind(self, timeout_s)  # a write blocked longer than the whole deadline fails
        if self._bulk is not None:
            hs.timeout_ms = max(1, round(timeout_s * 1e3))  # the receiver's deadline for this push
        self._builder = ChunkBuilder(ctx, request_id, layout, self._bulk is not None)
        handshake = encode_control(pb.PushMessage(handshake=hs))
        self._queue.put(("raw", handshake, 0))
        if self._bulk is not None:
            # The whole push goes over the bulk connection, written by a reused writer thread; the
            # receiver's result comes back on it (BulkCall). No gRPC call per push: opening one, and
            # its request and answer crossing grpcio's threads, cost more than a small push's data.
            self._written = threading.Event() if self._bulk.tls else None  # see BulkConnection.tls
            try:
                self._future: Any = BulkCall(self._bulk, self, target, after=self._written)  # or gRPC's call future
            except RuntimeError as exc:  # its reader thread could not start (a pids limit): nothing sent yet
                self._bulk.close()
                if isinstance(self._segment, SharedSegment):
                    self._segment.close()
                raise TransferFailed(f"cannot start a thread for the push: {exc}",
                                     grpc.StatusCode.UNAVAILABLE) from None
            self._future.add_done_callback(self._on_done)
            try:
                _BULK_WRITERS.submit(self._write_bulk)
            except RuntimeError as exc:  # as above, for its writer: the cancel gives back what it holds
                self.cancel(f"cannot start a thread for the push: {exc}")
                raise TransferFailed(f"cannot start a thread for the push: {exc}",
                                     grpc.StatusCode.UNAVAILABLE) from None
        else:
            call: Any = ctx.channel(target).stream_unary(PUSH_METHOD, request_serializer=None,
                                                       response_deserializer=pb.PushAck.FromString)
            self._future = call.future(self._messages(), timeout=timeout_s,
                                       metadata=ctx.security.call_metadata())
            self._future.add_done_callback(self._on_done)

    def _open_bulk(self, target: str, timeout_s: float) -> BulkConnection:
        channel = self.ctx.channel(target)

        def ticket(timeout: float) -> pb.BulkTicket:
            call: Any = channel.unary_unary(OPEN_BULK_METHOD, request_serializer=None,
                                       response_deserializer=pb.BulkTicket.FromString)
            try:
                return call(b"", timeout=timeout, metadata=self.ctx.security.call_metadata())
            except grpc.RpcError as exc:
                raise self._as_failure(exc) from None

        try:
            return self.ctx.bulk.take(target, ticket, min(timeout_s, 10.0))
        except BulkError as exc:
            code = grpc.StatusCode.DEADLINE_EXCEEDED if exc.kind == "timeout" else grpc.StatusCode.UNAVAILABLE
            raise TransferFailed(f"cannot open the bulk TCP connection to {target}: {exc}", code) from None

    def _lease_ipc(self, target: str, timeout_s: float) -> MappedSegment:
        """Lease a device segment of the receiver and map it (once per receiver epoch). The lease is asked
        for on the push's bulk connection when it has one (no RPC), else with OpenCudaIpc."""
        request = lease_request(self.request_id, self._segment_size())
        lease = self._lease_on_bulk(target, request, timeout_s) if self._bulk is not None else None
        if lease is None:
            call: Any = self.ctx.channel(target).unary_unary(OPEN_CUDA_IPC_METHOD, request_serializer=None,
                                                        response_deserializer=pb.CudaIpcLease.FromString)
            try:
                lease = call(request, timeout=min(timeout_s, 10.0), metadata=self.ctx.security.call_metadata())
            except grpc.RpcError as exc:
                raise self._as_failure(exc) from None
        try:
            tensor = self.ctx.ipc.open(target, lease)
        except (IpcError, RuntimeError) as exc:
            raise TransferFailed(f"cannot map the receiver's CUDA IPC segment: {exc}",
                                 grpc.StatusCode.FAILED_PRECONDITION) from None
        return MappedSegment(tensor, lease.pool_epoch, lease.segment)

    def _lease_on_bulk(self, target: str, request: bytes, timeout_s: float) -> pb.CudaIpcLease | None:
        """The lease asked for on ``_bulk``; a refusal raises TransferFailed with OpenCudaIpc's code. None
        when the receiver does not take leases there (it predates them: its connections are not asked for
        again for a while) or the connection broke: it is closed, this push's control goes on gRPC, and the
        lease is asked for with OpenCudaIpc."""
        bulk = self._bulk
        assert bulk is not None
        limit = min(timeout_s, 10.0)
        bulk.bind(self, limit)
        try:
            bulk.send_frame(KIND_LEASE, [request])
            _, data = bulk.read_message((KIND_LEASE_RESULT,), deadline=time.monotonic() + limit)
            result = pb.CudaIpcLeaseResult.FromString(data)
        except (BulkError, DecodeError) as exc:
            bulk.close()
            self._bulk = None
            if isinstance(exc, DecodeError) or exc.kind == "protocol":  # not a broken connection: an older peer
                self.ctx.bulk_control.failed(target, TransferFailed(f"no CUDA IPC lease on its bulk connection: "
                                                                    f"{exc}"))
            return None
        if result.code != grpc.StatusCode.OK.value[0]:
            raise TransferFailed(f"receiver refused a CUDA IPC lease: {result.message}",
                                 status_code(result.code))
        return result.lease

    def _control_connection(self, target: str, timeout_s: float) -> BulkConnection | None:
        """A shm or cuda_ipc push's bulk connection for its control messages, or None to send them on gRPC
        (the receiver has no bulk listener, or could not give a connection lately)."""
        if not self.ctx.bulk_control.usable(target):
            return None
        try:
            return self._open_bulk(target, timeout_s)
        except TransferFailed as exc:
            self.ctx.bulk_control.failed(target, exc)
            return None

    def _segment_size(self) -> int:
        """Bytes for every block sent (those after ``cached_blocks``), as encoded."""
        total = 0
        sent = self.num_blocks - self.cached_blocks
        for name in self.layout.layer_codecs:
            codec = get_codec(name)
            shape = self.layout.block_shape(sent)
            total += chunk_nbytes(codec, shape)
        # chunks split at block boundaries; per-chunk scale rounding cannot exceed the whole's size;
        # device segments start each chunk 16-byte aligned (at most one chunk per block and layer)
        return total + 4096 + 16 * sent * self.layout.num_layers

    # ------------------------------------------------------------------ producer side (prefill)
    def send_layer(self, layer: int, first_block: int, key: torch.Tensor, value: torch.Tensor) -> None:
        """Queue blocks [first_block, first_block + n) of ``layer``; key/value are [n, block, heads, dim]
        snapshots this stream now owns. Returns once queued (may wait for budget)."""
        self._raise_if_failed()
        if self._finished:
            raise TransferFailed("send_layer after finish")
        n = key.shape[0]
        if key.shape != value.shape or tuple(key.shape[1:]) != self.layout.block_shape(1)[1:]:
            raise ValueError(f"blocks must be [n, {self.layout.block_size}, {self.layout.num_kv_heads}, "
                             f"{self.layout.head_dim}], got {tuple(key.shape)} and {tuple(value.shape)}")
        if first_block < self.cached_blocks or first_block + n > self.num_blocks:
            raise ValueError(f"blocks {first_block}..{first_block + n - 1} outside the request's "
                             f"{self.cached_blocks}..{self.num_blocks - 1} (the receiver holds the first "
                             f"{self.cached_blocks})")
        codec = get_codec(self.layout.layer_codecs[layer])
        ready = wait_for_current(key.device)  # device input: encoders start after the snapshot's copy
        per_block = key[0].nbytes + value[0].nbytes if n else 0

        def make(i: int, m: int) -> functools.partial[Built]:
            return functools.partial(self._builder.build_at, layer, first_block + i, codec, key[i:i + m],
                                     value[i:i + m], ready)
        self._queue_chunks(codec, n, per_block, make)

    def send_blocks(self, layer: int, first_block: int, k_cache: CacheBlocks, v_cache: CacheBlocks,
                    ids: torch.Tensor) -> None:
        """Queue blocks [first_block, first_block + n) of ``layer`` read straight from the paged cache:
        ``k_cache``/``v_cache`` are the layer's [num_blocks, block, heads, dim] tensors (``QuantizedBlocks`` for
        a quantised layer) and ``ids`` (long, on their device) the n physical blocks, in order. Each chunk is
        encoded now on the caller's stream (kvtransfer.device_chunks: launch only, no wait), so the engine may
        overwrite the blocks in later work on that stream; only the encoded bytes are kept. Returns once
        queued (may wait for budget)."""
        self._raise_if_failed()
        if self._finished:
            raise TransferFailed("send_blocks after finish")
        n = ids.numel()
        if k_cache.shape != v_cache.shape or tuple(k_cache.shape[1:]) != self.layout.block_shape(1)[1:]:
            raise ValueError(f"caches must be [num_blocks, {self.layout.block_size}, {self.layout.num_kv_heads}, "
                             f"{self.layout.head_dim}], got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        if ids.device != k_cache.device or first_block < self.cached_blocks or first_block + n > self.num_blocks:
            raise ValueError(f"blocks {first_block}..{first_block + n - 1} (ids on {ids.device}) do not fit the "
                             f"request's {self.num_blocks} blocks on {k_cache.device}")
        codec = get_codec(self.layout.layer_codecs[layer])
        per_block = block_nbytes(k_cache) + block_nbytes(v_cache)

        def make(i: int, m: int) -> functools.partial[Built]:
            try:
                staged = encode_from_cache(codec, k_cache, v_cache, ids[i:i + m])
            except CodecError as exc:  # an eagerly encoding codec refuses now: fail the stream by name
                self._fail_encoding(CodecError(f"layer {layer}, blocks {first_block + i}..{first_block + i + m - 1}: "
                                               f"{exc}"))
                raise (fresh(self._error) if self._error else TransferFailed(str(exc))) from None
            return functools.partial(self._builder.build_staged, layer, first_block + i, staged)
        self._queue_chunks(codec, n, per_block, make)

    def _queue_chunks(self, codec: Codec, n: int, per_block: int,
                      make: Callable[[int, int], functools.partial[Built]]) -> None:
        """Number and queue a layer's n blocks as chunks sized for the transport; ``make(i, m)`` gives the
        builder of blocks [i, i + m), called with (seq, segment, offset) by an encoder or the sending thread."""
        one = self.layout.block_shape(1)  # chunks are sized by what goes on the wire, not the input dtype
        wire_per_block = max(1, chunk_nbytes(codec, one))
        segment = self._segment
        chunk_bytes = (self.ctx.sizes.shm if segment is not None else
                       self.ctx.sizes.bulk if self._bulk is not None else self.ctx.sizes.grpc)
        step = max(1, chunk_bytes // wire_per_block)
        if n:
            step = -(-n // -(-n // step))  # the same number of chunks, evenly sized (no runt last chunk)
        for i in range(0, n, step):
            m = min(step, n - i)
            cost = per_block * m
            self._budget.acquire(cost, self.deadline, self._failed)
            try:
                self.ctx.budget.acquire(cost, self.deadline, self._failed)
            except TransferFailed:
                self._budget.release(cost)
                raise
            try:
                build = make(i, m)  # outside the lock: a refusal there cancels the stream, which takes it
                # Numbering (and the segment range) is fixed here, in queue order, so the encoder
                # threads can frame whole chunks in parallel; gRPC's thread only sends them in order.
                with self._order:  # the failure check too: _on_done drains the queue under this lock
                    self._raise_if_failed()
                    seq = self._submitted
                    offset = -1
                    if segment is not None:
                        offset = self._reserve(segment, codec, self.layout.block_shape(m))
                    job: Any  # a partial (inline) or a Future (on an encoder thread)
                    if cost <= self.ctx.sizes.inline_build:  # built by the sending thread (_messages)
                        job = functools.partial(build, seq, segment, offset)
                    else:
                        job = self.ctx.encoders.submit(build, seq, segment, offset)
                    self._submitted += 1
                    self._queue.put(("layer", job, cost))
            except BaseException:
                self._budget.release(cost)
                self.ctx.budget.release(cost)
                raise

    def finish(self, first_token: int, first_logprobs: FirstLogprobs | None = None) -> PushResult:
        """Queue the finish message (with the first token, and its logprobs when the request asked for them)
        and wait for the receiver's ack."""
        self._raise_if_failed()
        self._finished = True
        self._queue.put(("finish", (first_token, first_logprobs), 0))
        try:
            ack = self._future.result(timeout=max(0.0, self.deadline - time.monotonic()) + 1.0)
        except grpc.RpcError as exc:
            raise self._as_failure(exc) from None
        except grpc.FutureTimeoutError:
            self.cancel("timed out waiting for the receiver's ack")
            raise TransferFailed("timed out waiting for the receiver's ack",
                                 grpc.StatusCode.DEADLINE_EXCEEDED) from None
        except grpc.FutureCancelledError:
            raise (fresh(self._error) if self._error else
                   TransferFailed("transfer cancelled", grpc.StatusCode.CANCELLED)) from None
        if ack.num_chunks != self._seq or ack.num_bytes != self._bytes or ack.checksum != self._checksum.value:
            self._settle_bulk(False)
            raise TransferFailed(f"receiver acknowledged {ack.num_chunks} chunks / {ack.num_bytes} bytes, sent "
                                 f"{self._seq} / {self._bytes}", grpc.StatusCode.DATA_LOSS)
        self._settle_bulk(True)  # now, not in the done callback, so the next stream finds it idle
        return PushResult(self.request_id, self._seq, self._bytes, self._logical, self.transport,
                          time.monotonic() - self.started)

    def cancel(self, reason: str = "cancelled by the sender") -> None:
        """Abort the stream on both sides (the receiver releases the reservation)."""
        if self._error is None:
            self._error = TransferFailed(reason, grpc.StatusCode.CANCELLED)
        self._failed.set()
        self._future.cancel()
        self._queue.put(("stop", None, 0))
        if self._bulk is not None:
            self._bulk.interrupt(self)  # wakes the writer thread if it is blocked writing to the connection

    @property
    def failed(self) -> bool:
        return self._failed.is_set()

    @property
    def error(self) -> TransferFailed | None:
        """Why the stream failed, once it has (None while it has not)."""
        return self._error if self._failed.is_set() else None

    def _raise_if_failed(self) -> None:
        if self._failed.is_set():
            raise fresh(self._error) if self._error else TransferFailed("transfer failed")

    def _as_failure(self, exc: grpc.RpcError | TransferFailed) -> TransferFailed:
        if isinstance(exc, TransferFailed):  # a BulkCall's
            return exc
        code = exc.code() if hasattr(exc, "code") else None
        details = exc.details() if hasattr(exc, "details") else str(exc)
        return TransferFailed(f"receiver refused the KV push: {details}", code)

    def _on_done(self, fut: Any) -> None:  # gRPC's call future, or a BulkCall
        err: TransferFailed | None
        if fut.cancelled():
            err = self._error or TransferFailed("transfer cancelled", grpc.StatusCode.CANCELLED)
        else:
            exc = fut.exception()
            err = self._as_failure(exc) if exc is not None else None
        with self._order:  # send_layer checks for failure and queues under this lock: nothing slips in after
            if err is not None:
                self._error = self._error or err
                self._failed.set()
            self._drain()
        self._queue.put(("stop", None, 0))
        if isinstance(self._segment, MappedSegment):  # the receiver ends the lease with the push
            self._segment = None
        if self._segment is not None:
            # Reuse only after a clean ack: after a failure the receiver may still be reading it.
            if err is None:
                self.ctx.segments.give(self._segment)
            else:
                self._segment.close()
            self._segment = None
        self._settle_bulk(err is None)

    def _drain(self) -> None:
        """Drop what is still queued once the call is over (nothing will send it; gRPC stops reading
        the request iterator when a call fails), returning its bytes to both budgets: otherwise a
        refused push would leave the sender-wide budget short for good."""
        while True:
            try:
                kind, item, cost = self._queue.get_nowait()
            except queue.Empty:
                return
            if kind == "layer" and not isinstance(item, functools.partial):
                item.cancel()  # an encoder that has not started it skips it
                if item.done() and not item.cancelled() and item.exception() is None:
                    self._give_back(item.result())
            self._budget.release(cost)
            self.ctx.budget.release(cost)

    def _settle_bulk(self, acked: bool) -> None:
        """Hand the bulk connection back once (reused only after a clean ack: after a failure it may
        hold half a stream, so it is closed)."""
        with self._order:  # held through the hand-back: whoever returns second finds it done
            bulk = self._bulk
            if bulk is None or self._bulk_settled:
                return
            self._bulk_settled = True
            if acked:
                self.ctx.bulk.give(self.target, bulk)
            else:
                bulk.interrupt(self)

    # ------------------------------------------------------------------ the sending thread
    def _write_bulk(self) -> None:
        """The bulk TCP transport's sending thread: ``_messages`` writes every chunk and the finish to
        the connection itself (it yields nothing here) until the finish or the stream fails."""
        try:
            for _ in self._messages():
                pass
        except Exception as exc:  # a bug: fail the stream by name rather than leave it to its deadline
            if self._error is None:
                self._error = TransferFailed(f"sending the KV push failed: {exc!r}", grpc.StatusCode.INTERNAL)
            self.cancel()
        finally:
            if self._written is not None:
                self._written.set()  # under TLS the result is read only now

    def _messages(self) -> Iterator[Any]:  # bytes for gRPC
        """What the stream sends, in order: gRPC's request iterator for Push, or (bulk TCP) run by
        ``_write_bulk``, writing to the connection."""
        while True:
            kind, item, cost = self._queue.get()
            if kind == "stop":
                return
            if kind == "raw":  # the handshake
                if self._bulk is not None:
                    self._send_bulk(KIND_HANDSHAKE, [item])
                    continue
                yield item
                continue
            if kind == "finish":
                finish = encode_control(pb.PushMessage(finish=finish_message(
                    self._seq, self._bytes, self._checksum.value, *item)))
                if self._bulk is not None:
                    self._send_bulk(KIND_FINISH, [finish])
                    return
                yield finish
                return
            try:
                inline = isinstance(item, functools.partial)
                if inline and self._failed.is_set():
                    continue  # never built
                try:
                    built: Built = item() if inline else item.result()
                except Exception as exc:  # NaN in the cache, ...: fail the stream by name, cancel the call
                    self._fail_encoding(exc)
                    continue  # later chunks are dropped as they come (their budget released) until "stop"
                if self._failed.is_set():
                    self._give_back(built)
                    continue
                self._seq += 1
                self._bytes += built.nbytes
                self._logical += built.logical
                self._checksum.add(built.checksum)
                message = built.message
                if self._bulk is not None:
                    # (a shm chunk's message is one bytes object; a tcp chunk's, its parts)
                    self._send_bulk(KIND_CHUNK, [message] if isinstance(message, bytes) else message)
                    del message
                    self._give_back(built)  # sendmsg has copied it into the kernel: reusable now
                    continue
                del built, item  # gRPC copies the message; drop our references as it goes
                yield message
            finally:
                self._budget.release(cost)
                self.ctx.budget.release(cost)

    def _fail_encoding(self, exc: Exception) -> None:
        if self._error is None:
            self._error = (TransferFailed(f"cannot send the KV cache: {exc}", grpc.StatusCode.INVALID_ARGUMENT)
                           if isinstance(exc, CodecError) else
                           TransferFailed(f"encoding a KV chunk failed: {exc!r}", grpc.StatusCode.INTERNAL))
        self.cancel()

    def _give_back(self, built: Built) -> None:
        self._builder.give_back(built)

    def _send_bulk(self, kind: int, parts: list) -> None:
        """Write one message to the bulk connection (on the stream's writer thread, which this keeps busy,
        in order); on failure, fail the stream and cancel its call."""
        if self._bulk is None or self._failed.is_set():
            return
        try:
            self._bulk.send_frame(kind, parts)
        except BulkError as exc:
            if not self._failed.is_set():
                code = grpc.StatusCode.DEADLINE_EXCEEDED if exc.kind == "timeout" else grpc.StatusCode.UNAVAILABLE
                self._error = TransferFailed(f"bulk TCP connection to {self.target} failed: {exc}", code)
                self._failed.set()
                self._future.cancel()

    def _reserve(self, segment: SharedSegment | MappedSegment, codec: Codec, shape: tuple[int, ...]) -> int:
        """The segment offset of the next chunk (under ``_order``); chunks lie back to back."""
        nbytes = chunk_nbytes(codec, shape)
        offset = self._shm_offset
        if isinstance(segment, MappedSegment):  # aligned, so the receiver views scales as float32 in place
            offset = -(-offset // IPC_ALIGNMENT) * IPC_ALIGNMENT
        if offset + nbytes > segment.size:
            raise TransferFailed(f"chunk of {nbytes} bytes does not fit the {segment.size}-byte shared "
                                 f"segment at offset {offset} (more blocks sent than the stream announced?)")
        self._shm_offset = offset + nbytes
        return offset
