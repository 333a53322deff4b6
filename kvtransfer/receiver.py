"""The receiving end of a KV push (runs on the decode worker).

A transfer's life on this side:
  1. EXPECTED   ``expect`` registers the request id, the blocks reserved for it and a deadline.
  2. STREAMING  a push's handshake names the request (on a Push stream, or on a bulk TCP connection,
                see ``serve_bulk``); its layout is checked against ours.
                Each chunk is checked (request id, sequence number, layer, codec, block range,
                byte sizes, checksum, not seen before) and only then written into the reserved
                blocks through the ``KVSink``.
  3. COMPLETE   the finish message's totals match and every block of every layer has landed;
                ``on_done`` gets the first token.
  4. FAILED     any refused message, a cancelled or broken stream, ``cancel`` or the deadline:
                ``on_done`` gets the error, and the caller releases the blocks. The stream ends
                with a status that names the problem (on a bulk connection, a PushResult that
                carries it); other transfers are unaffected.
``on_done`` is called exactly once per expected request.
"""

from __future__ import annotations

import itertools
import logging
import math
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Protocol

import grpc
import torch

from kvtransfer.bulk import (
    CONTROL_BYTES,
    KIND_CHUNK,
    KIND_HANDSHAKE,
    KIND_LEASE,
    KIND_LEASE_RESULT,
    KIND_RESULT,
    BulkConnection,
    BulkError,
)
from kvtransfer.bulk_listener import BulkListener
from kvtransfer.checksum import StreamChecksum, chunk_checksum
from kvtransfer.chunks import non_finite_values
from kvtransfer.codecs import CodecError, Kind, WireLayout, get_codec
from kvtransfer.codecs.encoded import cut_pair
from kvtransfer.cuda_ipc import DeviceParts, IpcError, IpcPool, device_chunk_parts
from kvtransfer.errors import TransferRefused, fresh
from kvtransfer.expectations import Expectations, Expected, State, refusal, run_stream, shown_id
from kvtransfer.layout import KVLayout, LayoutMismatch
from kvtransfer.shm import SegmentCache, SharedSegment, ShmError, reap_orphans
from kvtransfer.wire import PROTOCOL_VERSION, FirstLogprobs, Frame, WireError, decode_frame, pb

log = logging.getLogger(__name__)
Code = grpc.StatusCode
_NO_LISTENER = ("this receiver has no bulk TCP listener; use the grpc or shm transport (shm then carries its "
                "control on gRPC)")
# How often the janitor removes shared-memory segments whose sender process has died (kvtransfer.shm):
# a crashed prefill worker's pooled segments (up to 1 GiB of RAM in /dev/shm) go within this long, even
# when no new sender starts on the host to reap them.
ORPHAN_REAP_S = 5.0
# After refusing a push on a bulk connection: how long to keep reading (and dropping) what the sender still
# sends, so that it reads the refusal before the connection closes.
DRAIN_S = 5.0
# How long a Push stream may stay open before its handshake arrives. It holds a stream slot meanwhile, and
# until the handshake names a request no transfer's deadline covers it; past this the call is cancelled.
HANDSHAKE_S = 10.0


@dataclass(frozen=True)
class WireParts:
    """One tensor's encoded bytes as received: views into the message or shared segment, no copy."""

    payload: memoryview
    scales: memoryview
    zeros: memoryview | None


class KVSink(Protocol):
    """Where received blocks land (the decode worker's paged cache). Called with physical block ids
    taken from the request's reservation, never with ids chosen by the sender."""

    def write(self, layer: int, blocks: Sequence[int], codec: str, shape: tuple[int, int, int, int],
              key: WireParts, value: WireParts) -> None: ...

    def write_device(self, layer: int, blocks: Sequence[int], codec: str, shape: tuple[int, int, int, int],
                     key: DeviceParts, value: DeviceParts) -> None:
        """``write`` for parts already in the cache's device memory (TRANSPORT_CUDA_IPC)."""


MAX_TOP_LOGPROBS = 20  # workers.runtime.sampler.MAX_LOGPROBS: the most a request may ask for


def first_logprobs_of(f: pb.PushFinish) -> FirstLogprobs | None:
    """The finish's first-token logprobs (None when not sent); TransferRefused when they are malformed."""
    if not f.HasField("first_logprob"):
        if f.first_top_ids or f.first_top_logprobs:
            raise TransferRefused(Code.INVALID_ARGUMENT, "finish has top logprobs without the first token's")
        return None
    if math.isnan(f.first_logprob):
        raise TransferRefused(Code.INVALID_ARGUMENT, "finish's first_logprob is NaN")
    if len(f.first_top_ids) != len(f.first_top_logprobs) or len(f.first_top_ids) > MAX_TOP_LOGPROBS:
        raise TransferRefused(Code.INVALID_ARGUMENT, f"finish has {len(f.first_top_ids)} top token ids and "
                                                     f"{len(f.first_top_logprobs)} top logprobs (equal counts, "
                                                     f"at most {MAX_TOP_LOGPROBS})")
    if any(math.isnan(v) for v in f.first_top_logprobs):
        raise TransferRefused(Code.INVALID_ARGUMENT, "finish's first_top_logprobs hold a NaN")
    return f.first_logprob, tuple(zip(f.first_top_ids, f.first_top_logprobs))


@dataclass(frozen=True)
class TransferOutcome:
    request_id: str
    ok: bool
    first_token: int | None = None
    # the first token's log-probability and the most likely tokens' (id, log-probability), when sent
    first_logprobs: FirstLogprobs | None = None
    code: grpc.StatusCode | None = None
    error: str | None = None
    num_chunks: int = 0
    num_bytes: int = 0


class KVReceiver:
    """Validates and lands KV pushes for the requests it was told to expect."""

    def __init__(self, layout: KVLayout, sink: KVSink, *, max_streams: int = 64,
                 max_chunk_bytes: int = 64 * 2**20, clock: Callable[[], float] = time.monotonic) -> None:
        self.layout = layout
        self.sink = sink
        self.max_chunk_bytes = max_chunk_bytes
        self.expectations: Expectations[TransferOutcome] = Expectations(
            lambda rid, err: TransferOutcome(rid, False, code=err.code, error=err.message), clock)
        self._streams = threading.BoundedSemaphore(max_streams)
        self.segments = SegmentCache()
        self.bulk: BulkListener | None = None
        self.ipc: IpcPool | None = None
        self.orphan_reap_s = ORPHAN_REAP_S
        self.handshake_s = HANDSHAKE_S
        self._unnamed: dict[int, tuple[float, grpc.ServicerContext]] = {}  # Push streams before their handshake
        self._unnamed_ids = itertools.count()
        self._unnamed_lock = threading.Lock()
        self._clock = clock
        self._next_reap = clock()

    def enable_bulk(self, host: str, port: int = 0, ssl_context: ssl.SSLContext | None = None) -> int:
        """Listen for bulk TCP connections on ``host`` (the address the gRPC server is bound to), over
        TLS when given ``ssl_context`` (``TransferSecurity.ssl_context(server_side=True)``); returns the
        port. Without this, OpenBulk is refused and senders use gRPC or shared memory."""
        if self.bulk is None:
            self.bulk = BulkListener(host, self.serve_bulk, port, ssl_context=ssl_context)
        return self.bulk.port

    def enable_cuda_ipc(self, pool: IpcPool) -> None:
        """Accept TRANSPORT_CUDA_IPC pushes into ``pool``'s device segments (on the cache's device); without
        this, OpenCudaIpc is refused and senders use another transport. A worker allocates the pool before its
        engine sizes the KV pool from free memory, so that sizing counts the segments."""
        if self.ipc is None:
            self.ipc = pool

    def open_cuda_ipc(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Handler for KVTransfer.OpenCudaIpc: lease a device segment to an expected request's push."""
        try:
            return self._lease(request).SerializeToString()
        except TransferRefused as exc:
            context.abort(exc.code, exc.message)
        raise AssertionError("unreachable: context.abort raises")

    def _lease(self, request: bytes) -> pb.CudaIpcLease:
        """A device segment leased to an expected request's push (``request``: CudaIpcLeaseRequest bytes,
        from OpenCudaIpc or a bulk connection); TransferRefused names why not."""
        if self.ipc is None:
            raise TransferRefused(Code.FAILED_PRECONDITION, "this receiver has no CUDA IPC pool; use another transport")
        try:
            req = pb.CudaIpcLeaseRequest.FromString(request)
        except Exception:  # protobuf's DecodeError
            raise TransferRefused(Code.INVALID_ARGUMENT, "malformed CudaIpcLeaseRequest") from None
        if req.request_id not in self.expectations:
            raise TransferRefused(Code.NOT_FOUND, f"no reservation for request {shown_id(req.request_id)}")
        try:
            return self.ipc.lease(req.request_id, req.min_bytes)
        except IpcError as exc:
            raise TransferRefused(Code.RESOURCE_EXHAUSTED, str(exc)) from None

    # ------------------------------------------------------------------ control (decode worker side)
    def expect(self, request_id: str, blocks: Sequence[int], on_done: Callable[[TransferOutcome], None],
               timeout_s: float, cached_blocks: int = 0) -> None:
        """Accept one push for ``request_id`` into ``blocks`` (physical ids, in logical order) until
        ``timeout_s`` from now. The first ``cached_blocks`` hold their KV already (this worker's prefix cache):
        the push must say so in its handshake and send only the blocks after them."""
        if cached_blocks < 0 or (cached_blocks and cached_blocks >= len(blocks)):
            raise ValueError(f"cached_blocks must be in [0, {len(blocks)}), got {cached_blocks}")
        self.expectations.add(request_id, ReservedBlocks(tuple(blocks), cached_blocks), on_done, timeout_s)

    def retarget(self, request_id: str, blocks: Sequence[int], cached_blocks: int = 0) -> bool:
        """Land an expected push in other ``blocks`` (as ``expect`` takes them); False (nothing changes) once a
        stream has claimed it, or when it is not expected."""
        return self.expectations.retarget(request_id, ReservedBlocks(tuple(blocks), cached_blocks))

    def cancel(self, request_id: str, reason: str = "cancelled by the receiver") -> bool:
        """Fail an expected or streaming transfer now (its stream ends with CANCELLED)."""
        return self.expectations.cancel(request_id, reason)

    def sweep(self) -> list[str]:
        """Fail every transfer past its deadline, and cancel every Push stream still without a handshake
        ``handshake_s`` after it opened; returns the failed transfers' ids. The janitor does this too."""
        expired = self.expectations.sweep()
        self._cancel_unnamed()
        return expired

    def start_janitor(self, interval_s: float = 0.05) -> None:
        def housekeeping() -> None:
            self._cancel_unnamed()
            self._prune()
        self.expectations.start_janitor(interval_s, also=housekeeping)

    def _cancel_unnamed(self) -> None:
        now = self._clock()
        with self._unnamed_lock:
            overdue = [key for key, (deadline, _) in self._unnamed.items() if now >= deadline]
            contexts = [self._unnamed.pop(key)[1] for key in overdue]
        for context in contexts:
            log.warning("a KV Push stream sent no handshake within %.0f s of opening; cancelled it", self.handshake_s)
            context.cancel()

    def _prune(self) -> None:
        """The janitor's housekeeping: dead senders' segments removed (every ``orphan_reap_s``), then
        the mappings of removed segments dropped."""
        now = self._clock()
        if now >= self._next_reap:
            self._next_reap = now + self.orphan_reap_s
            try:
                removed = reap_orphans()
            except OSError as exc:  # /dev/shm unreadable: nothing to reap here, and no reason to stop
                log.warning("could not look for dead senders' shared-memory segments: %s", exc)
            else:
                if removed:
                    log.info("removed %d shared-memory segment(s) of dead KV senders", len(removed))
        self.segments.prune()
        if self.ipc is not None:
            self.ipc.release_stale(self.expectations.__contains__)

    def stop(self) -> None:
        self.expectations.stop()
        self.segments.close()
        if self.bulk is not None:
            self.bulk.close()

    @property
    def pending(self) -> int:
        return len(self.expectations)

    @property
    def awaiting_handshake(self) -> int:
        """Push streams open whose handshake has not arrived yet."""
        with self._unnamed_lock:
            return len(self._unnamed)

    # ------------------------------------------------------------------ the Push RPC
    def push(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> bytes:
        """Handler for KVTransfer.Push (raw bytes in, serialized PushAck out)."""
        if not self._streams.acquire(timeout=5.0):
            context.abort(Code.RESOURCE_EXHAUSTED, "too many KV streams in flight on this receiver; retry")
        try:
            return run_stream(self.expectations, context, lambda bound: self._run(requests, bound, context))
        finally:
            self._streams.release()

    def open_bulk(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """Handler for KVTransfer.OpenBulk: a ticket for one bulk TCP connection (see kvtransfer.bulk)."""
        if self.bulk is None:
            context.abort(Code.FAILED_PRECONDITION, _NO_LISTENER)
        try:
            return self.bulk.issue().SerializeToString()
        except BulkError as exc:
            context.abort(Code.RESOURCE_EXHAUSTED, str(exc))
        raise AssertionError("unreachable: context.abort raises")

    def _run(self, requests: Iterator[bytes], bound: list, context: grpc.ServicerContext) -> bytes:
        first = self._handshake(requests, context)
        if first is None or first.kind != "handshake":
            raise TransferRefused(Code.INVALID_ARGUMENT, "a Push stream must open with a handshake")
        # failed from outside (expired, cancelled): the call ends, even while it waits for a silent sender
        exp = self.expectations.claim(first.header.request_id, wake=lambda _: context.cancel())
        bound.append(exp)
        if first.header.transport == pb.TRANSPORT_TCP:  # the reservation is released with this refusal
            raise TransferRefused(Code.INVALID_ARGUMENT, "a TRANSPORT_TCP push travels whole over its bulk TCP "
                                                         "connection (opened with OpenBulk), not on Push")
        return self._land(exp, first.header, self._frames(requests)).SerializeToString()

    def _land(self, exp: Expected, hs: pb.PushHandshake, frames: Iterator[Frame]) -> pb.PushAck:
        """Check and land a push's chunks up to its finish; the ack."""
        session = self._open(exp, hs)
        try:
            for frame in frames:
                if frame.kind == "chunk":
                    self._chunk(exp, session, frame)
                elif frame.kind == "finish":
                    session.finished = True  # the sender sends it after its last write, whatever comes of it
                    return self._finish(exp, session, frame.header)
                else:
                    raise TransferRefused(Code.INVALID_ARGUMENT, "a second handshake on the same stream")
            raise TransferRefused(Code.DATA_LOSS, "the stream ended before its finish message (sender gone?)")
        finally:
            session.close()

    # ------------------------------------------------------------------ pushes on bulk TCP connections
    def serve_bulk(self, conn: BulkConnection) -> None:
        """An authenticated bulk connection's pushes, one after another, until it closes (on the
        listener's thread for it). Each push ends with a PushResult; after a refusal the connection
        is drained (so the sender reads the result) and closed."""
        while True:
            conn.unbind()  # idle: wait for the next handshake as long as the sender keeps the connection
            try:
                kind, data = conn.read_message((KIND_HANDSHAKE, KIND_LEASE))
            except BulkError as exc:
                if exc.kind != "protocol":
                    return  # the sender closed it, or the listener is closing
                code, message, ack = Code.INVALID_ARGUMENT, f"a push must open with a handshake: {exc}", None
            else:
                if kind == KIND_LEASE:  # a cuda_ipc push's segment, asked for here instead of by OpenCudaIpc
                    try:
                        conn.send_frame(KIND_LEASE_RESULT, [self._lease_result(data).SerializeToString()])
                    except BulkError:
                        return
                    continue
                code, message, ack = self._bulk_push(conn, data)
            result = pb.PushResult(code=code.value[0], message=message, ack=ack)
            try:
                conn.send_frame(KIND_RESULT, [result.SerializeToString()])
            except BulkError:
                return
            if code is not Code.OK:
                conn.drain(DRAIN_S)
                return

    def _lease_result(self, request: bytes) -> pb.CudaIpcLeaseResult:
        try:
            return pb.CudaIpcLeaseResult(code=Code.OK.value[0], lease=self._lease(request))
        except TransferRefused as exc:
            return pb.CudaIpcLeaseResult(code=exc.code.value[0], message=exc.message)

    def _bulk_push(self, conn: BulkConnection, data: bytes) -> tuple[grpc.StatusCode, str, pb.PushAck | None]:
        """One push on a bulk connection, from its handshake: (status, message, ack). Refusals fail the
        reservation as on Push."""
        if not self._streams.acquire(timeout=5.0):
            return Code.RESOURCE_EXHAUSTED, "too many KV streams in flight on this receiver; retry", None
        bound: list[Expected] = []
        owner = object()  # this push's hold on the connection: a late wake-up cannot close the next push's
        try:
            first = _decode(data)
            hs: pb.PushHandshake = first.header
            if first.kind != "handshake":
                raise TransferRefused(Code.INVALID_ARGUMENT, "a push must open with a handshake")
            exp = self.expectations.claim(hs.request_id, wake=lambda _: conn.interrupt(owner))
            bound.append(exp)
            if hs.transport not in (pb.TRANSPORT_TCP, pb.TRANSPORT_SHARED_MEMORY, pb.TRANSPORT_CUDA_IPC):
                raise TransferRefused(Code.INVALID_ARGUMENT, "a push on a bulk TCP connection must say "
                                                             "TRANSPORT_TCP, TRANSPORT_SHARED_MEMORY or "
                                                             "TRANSPORT_CUDA_IPC in its handshake")
            if hs.timeout_ms == 0:
                raise TransferRefused(Code.INVALID_ARGUMENT, "a handshake on a bulk TCP connection must carry "
                                                             "timeout_ms, the push's deadline")
            # the sender's deadline, but never past the reservation's (then the push has failed already)
            timeout_s = min(hs.timeout_ms / 1e3, max(0.0, exp.deadline - self.expectations.clock()))
            deadline = time.monotonic() + timeout_s
            conn.bind(owner, timeout_s)  # timeout mode: each read then waits until the deadline at most
            return Code.OK, "", self._land(exp, hs, self._bulk_frames(conn, deadline, hs.transport))
        except Exception as exc:
            err = refusal(self.expectations, bound, exc)
            return err.code, err.message, None
        finally:
            conn.release(owner)  # a wake-up after this must not close the connection while it drains
            self._streams.release()

    def _bulk_frames(self, conn: BulkConnection, deadline: float, transport: int) -> Iterator[Frame]:
        codes = {"closed": Code.CANCELLED, "timeout": Code.DEADLINE_EXCEEDED, "protocol": Code.INVALID_ARGUMENT}
        if transport == pb.TRANSPORT_TCP:  # chunks carry their bytes: read the next while this one lands
            frames = conn.read_frames(self.max_chunk_bytes + 4096, deadline)  # + the chunk's header fields
        else:  # shared memory, CUDA IPC: frames are control messages only, read on this thread as they come
            frames = conn.read_frames(CONTROL_BYTES, deadline, ahead=False)
        while True:
            try:
                kind, view = next(frames)
            except StopIteration:  # after the finish frame; the caller stops before asking again
                return
            except BulkError as exc:
                what = {"closed": "the sender cancelled or went away (its bulk connection closed before the finish)",
                        "timeout": "the transfer's deadline passed"}.get(exc.kind, str(exc))
                raise TransferRefused(codes.get(exc.kind, Code.DATA_LOSS), what) from None
            frame = _decode(view)
            if frame.kind != ("chunk" if kind == KIND_CHUNK else "finish"):
                raise TransferRefused(Code.INVALID_ARGUMENT, f"a {frame.kind} message in a bulk frame of kind {kind}")
            yield frame

    def _handshake(self, requests: Iterator[bytes], context: grpc.ServicerContext) -> Frame | None:
        """A Push stream's first message (None: the stream ended first). The janitor cancels the call when
        none comes within ``handshake_s``."""
        key = next(self._unnamed_ids)
        with self._unnamed_lock:
            self._unnamed[key] = (self._clock() + self.handshake_s, context)
        try:
            return self._next(requests)
        finally:
            with self._unnamed_lock:
                self._unnamed.pop(key, None)

    @staticmethod
    def _next(requests: Iterator[bytes]) -> Frame | None:
        data = next(requests, None)
        return None if data is None else _decode(data)

    @staticmethod
    def _frames(requests: Iterator[bytes]) -> Iterator[Frame]:
        for data in requests:
            yield _decode(data)

    def _open(self, exp: Expected, hs: pb.PushHandshake) -> _Session:
        if hs.protocol_version != PROTOCOL_VERSION:
            raise TransferRefused(Code.FAILED_PRECONDITION,
                                  f"protocol version {hs.protocol_version} is not supported (this receiver "
                                  f"speaks {PROTOCOL_VERSION})")
        try:
            sender = KVLayout.from_proto(hs.layout)
            self.layout.check_compatible(sender)
        except (LayoutMismatch, CodecError) as exc:
            raise TransferRefused(Code.FAILED_PRECONDITION, f"layout mismatch: {exc}") from None
        nblocks = sender.blocks_for(hs.num_tokens)
        reserved: ReservedBlocks = exp.target
        if hs.num_tokens == 0 or nblocks != len(reserved.blocks):  # fewer would leave reserved blocks stale
            raise TransferRefused(Code.OUT_OF_RANGE, f"{hs.num_tokens} tokens need {nblocks} blocks; "
                                                     f"{len(reserved.blocks)} are reserved for {hs.request_id!r}")
        if hs.cached_blocks != reserved.cached:
            raise TransferRefused(Code.FAILED_PRECONDITION,
                                  f"the push skips {hs.cached_blocks} blocks as cached here; this worker's prefix "
                                  f"cache holds {reserved.cached} of {hs.request_id!r}'s (its Holds reply said so)")
        segment = None
        if hs.transport == pb.TRANSPORT_CUDA_IPC:
            ipc = self.ipc
            if ipc is None:
                raise TransferRefused(Code.FAILED_PRECONDITION, "this receiver has no CUDA IPC pool")
            try:
                device_segment = ipc.check(hs.request_id, hs.ipc_epoch, hs.ipc_segment)
            except IpcError as exc:
                ipc.release(hs.request_id)
                raise TransferRefused(Code.FAILED_PRECONDITION, str(exc)) from None
            return _Session(sender, hs.num_tokens, nblocks, None, self.segments, device_segment,
                            lambda clean: ipc.release(hs.request_id, clean), cached_blocks=reserved.cached)
        if hs.transport == pb.TRANSPORT_SHARED_MEMORY:
            try:
                segment = self.segments.attach(hs.shm_name, hs.shm_size)
            except ShmError as exc:
                raise TransferRefused(Code.FAILED_PRECONDITION, f"shared-memory transport unavailable: {exc}; "
                                                                "use the gRPC transport") from None
        elif hs.transport not in (pb.TRANSPORT_GRPC, pb.TRANSPORT_TCP):
            raise TransferRefused(Code.INVALID_ARGUMENT, f"unknown transport {hs.transport}")
        return _Session(sender, hs.num_tokens, nblocks, segment, self.segments, cached_blocks=reserved.cached)

    def _chunk(self, exp: Expected, s: _Session, frame: Frame) -> None:
        c: pb.KVChunk = frame.header
        where = f"chunk seq {c.seq} (layer {c.layer}, blocks {c.first_block}..{c.first_block + c.num_blocks - 1})"
        if c.request_id != exp.request_id:
            raise TransferRefused(Code.INVALID_ARGUMENT,
                                  f"{where} is for request {shown_id(c.request_id)} on the stream of "
                                  f"{exp.request_id!r}")
        if c.seq != s.next_seq:
            raise TransferRefused(Code.INVALID_ARGUMENT, f"{where} out of order or duplicated: expected seq "
                                                         f"{s.next_seq}")
        if c.layer >= s.layout.num_layers:
            raise TransferRefused(Code.INVALID_ARGUMENT, f"{where}: no layer {c.layer} in a "
                                                         f"{s.layout.num_layers}-layer model")
        codec_name = s.layout.layer_codecs[c.layer]
        codec = get_codec(codec_name)
        if c.codec != int(codec.codec_id):
            raise TransferRefused(Code.INVALID_ARGUMENT, f"{where}: codec {c.codec} but the handshake gave "
                                                         f"layer {c.layer} codec {codec_name}")
        if c.num_blocks == 0 or c.first_block + c.num_blocks > s.num_blocks:
            raise TransferRefused(Code.OUT_OF_RANGE, f"{where} lies outside the request's {s.num_blocks} blocks")
        shape = s.layout.block_shape(c.num_blocks)
        k_lay, v_lay = codec.layout(shape, Kind.KEY), codec.layout(shape, Kind.VALUE)
        want_scales = k_lay.scale_nbytes + k_lay.zero_nbytes + v_lay.scale_nbytes + v_lay.zero_nbytes
        want_payload = k_lay.payload_nbytes + v_lay.payload_nbytes
        if want_scales + want_payload > self.max_chunk_bytes:
            raise TransferRefused(Code.INVALID_ARGUMENT, f"{where} is {want_scales + want_payload} bytes, over "
                                                         f"this receiver's limit of {self.max_chunk_bytes}")
        if s.device_segment is not None:  # TRANSPORT_CUDA_IPC: checked and read where it lies, on the device
            if frame.payload.nbytes or frame.scales.nbytes:
                raise TransferRefused(Code.INVALID_ARGUMENT, f"{where}: inline bytes on a CUDA IPC stream")
            key: WireParts | DeviceParts
            value: WireParts | DeviceParts
            key, value = device_chunk_parts(s.device_segment, c, where, codec_name, k_lay, v_lay, want_scales,
                                            want_payload)
            write: Callable[..., None] = self.sink.write_device
            nbytes = c.shm.length
        else:
            scales, payload = s.bulk(c, frame, want_scales)
            if scales.nbytes != want_scales or payload.nbytes != want_payload:
                raise TransferRefused(Code.INVALID_ARGUMENT,
                                      f"{where} carries {scales.nbytes}+{payload.nbytes} bytes of scales+payload, "
                                      f"expected {want_scales}+{want_payload} for codec {codec_name}")
            if chunk_checksum((scales, payload)) != c.checksum:
                raise TransferRefused(Code.DATA_LOSS, f"{where}: checksum mismatch, the data was corrupted")
            problem = non_finite_values(codec_name, k_lay.scales_dtype, scales, payload)
            if problem is not None:
                raise TransferRefused(Code.INVALID_ARGUMENT,
                                      f"{where}: {problem}; refusing to land a corrupt KV cache")
            key, value = _split(k_lay, v_lay, scales, payload)
            write = self.sink.write
            nbytes = scales.nbytes + payload.nbytes
        covered = s.coverage[c.layer]
        if any(covered[c.first_block:c.first_block + c.num_blocks]):
            raise TransferRefused(Code.INVALID_ARGUMENT, f"{where} overlaps blocks already received (or cached here)")
        blocks = exp.target.blocks[c.first_block:c.first_block + c.num_blocks]
        with exp.lock:
            if exp.state is not State.STREAMING:  # cancelled or expired meanwhile: the blocks may be gone
                raise fresh(exp.failure) if exp.failure else TransferRefused(Code.CANCELLED, "transfer cancelled")
            try:
                write(c.layer, blocks, codec_name, shape, key, value)
            except (CodecError, ValueError) as exc:
                raise TransferRefused(Code.INVALID_ARGUMENT, f"{where}: {exc}") from None
        covered[c.first_block:c.first_block + c.num_blocks] = b"\x01" * c.num_blocks
        s.next_seq += 1
        s.num_bytes += nbytes
        s.checksum.add(c.checksum)

    def _finish(self, exp: Expected, s: _Session, f: pb.PushFinish) -> pb.PushAck:
        if f.num_chunks != s.next_seq or f.num_bytes != s.num_bytes or f.checksum != s.checksum.value:
            raise TransferRefused(Code.DATA_LOSS, f"finish totals disagree: sender sent {f.num_chunks} chunks / "
                                                  f"{f.num_bytes} bytes, receiver got {s.next_seq} / {s.num_bytes}")
        for layer, covered in enumerate(s.coverage):
            missing = covered.count(0)
            if missing:
                raise TransferRefused(Code.DATA_LOSS, f"truncated transfer: layer {layer} is missing {missing} of "
                                                      f"{s.num_blocks} blocks")
        self.expectations.complete(exp, TransferOutcome(exp.request_id, True, first_token=f.first_token,
                                                        first_logprobs=first_logprobs_of(f),
                                                        num_chunks=s.next_seq, num_bytes=s.num_bytes))
        return pb.PushAck(request_id=exp.request_id, num_chunks=s.next_seq, num_bytes=s.num_bytes,
                          checksum=s.checksum.value)


@dataclass(frozen=True)
class ReservedBlocks:
    """What a KV push lands in: the reserved blocks, in logical order, of which the first ``cached`` hold their
    KV already."""

    blocks: tuple[int, ...]
    cached: int = 0


class _Session:
    """Per-stream progress: what has arrived, in which order, and through which transport."""

    def __init__(self, layout: KVLayout, num_tokens: int, num_blocks: int, segment: SharedSegment | None,
                 cache: SegmentCache | None = None, device_segment: torch.Tensor | None = None,
                 on_close: Callable[[bool], None] | None = None, cached_blocks: int = 0) -> None:
        self.device_segment = device_segment  # TRANSPORT_CUDA_IPC: the leased device segment
        self._on_close = on_close  # called with whether the push's finish arrived
        self.finished = False
        self.cache = cache
        self.layout = layout
        self.num_tokens = num_tokens
        self.num_blocks = num_blocks
        self.segment = segment
        # per layer, the blocks that hold their KV: the cached ones from the start, the rest as they land
        self.coverage = [bytearray(b"\x01" * cached_blocks) + bytearray(num_blocks - cached_blocks)
                         for _ in range(layout.num_layers)]
        self.next_seq = 0
        self.num_bytes = 0
        self.checksum = StreamChecksum()

    def bulk(self, c: pb.KVChunk, frame: Frame, scales_nbytes: int) -> tuple[memoryview, memoryview]:
        if self.segment is None:
            if c.HasField("shm"):
                raise TransferRefused(Code.INVALID_ARGUMENT, "shared-memory reference on a gRPC-transport stream")
            return frame.scales, frame.payload
        if frame.payload.nbytes or frame.scales.nbytes:
            raise TransferRefused(Code.INVALID_ARGUMENT, "inline bytes on a shared-memory stream")
        try:
            view = self.segment.view(c.shm.offset, c.shm.length)
        except ShmError as exc:
            raise TransferRefused(Code.OUT_OF_RANGE, f"chunk seq {c.seq}: {exc}") from None
        return view[:scales_nbytes], view[scales_nbytes:]

    def close(self) -> None:
        if self._on_close is not None:
            self._on_close(self.finished)  # the IPC lease ends with the push
            self._on_close = None
        if self.segment is not None and self.cache is not None:
            self.cache.release(self.segment)  # the mapping stays cached for the next stream
        self.segment = None


def _decode(data: bytes | memoryview) -> Frame:
    try:
        return decode_frame(data, pb.PushMessage, pb.KVChunk)
    except WireError as exc:
        raise TransferRefused(Code.INVALID_ARGUMENT, f"malformed message: {exc}") from None


def _split(k_lay: WireLayout, v_lay: WireLayout, scales: memoryview,
           payload: memoryview) -> tuple[WireParts, WireParts]:
    """Cut a chunk's scales (k scales, k zeros, v scales, v zeros) and payload (k, v) into the two tensors."""
    k, v = cut_pair(k_lay, v_lay, scales, payload)
    return WireParts(*k), WireParts(*v)
