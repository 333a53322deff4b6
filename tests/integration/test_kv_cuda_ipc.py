"""The CUDA IPC transport's receiving end, through a real gRPC server: leases, the pool epoch (a restarted
receiver refuses a stale mapping), offsets, the device checksum, and landing by block index.

On CPU the receiver's pool lives in host memory and the test writes the chunk bytes into the leased
segment itself, as a mapped sender would; the ``cuda`` tests map a real IPC handle from a pool on the
GPU and push through ``KVSender`` (skipped without a GPU)."""

from __future__ import annotations

import secrets
import socket
import time
from typing import Any

import grpc
import pytest
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.bulk import (
    KIND_CHUNK,
    KIND_FINISH,
    KIND_HANDSHAKE,
    KIND_LEASE,
    KIND_LEASE_RESULT,
    KIND_RESULT,
    OK,
    BulkConnection,
    BulkError,
)
from kvtransfer.checksum import StreamChecksum
from kvtransfer.chunks import chunk_nbytes
from kvtransfer.codecs import Kind, get_codec
from kvtransfer.cuda_ipc import IpcError, IpcMappings, IpcPool, lease_request
from kvtransfer.device_checksum import device_checksum
from kvtransfer.errors import TransferFailed
from kvtransfer.options import CHANNEL_OPTIONS
from kvtransfer.receiver import KVReceiver, TransferOutcome
from kvtransfer.sender import KVSender
from kvtransfer.server import kv_transfer_handler, start_server
from kvtransfer.wire import OPEN_CUDA_IPC_METHOD, PROTOCOL_VERSION, PUSH_METHOD, encode_control, pb
from tests.integration.kv_helpers import connect, frame, open_bulk, read_message, tiny_model
from workers.decode.kv_sink import CacheSink
from workers.prefill.kv_stream import engine_layout
from workers.runtime.engine import Engine, EngineConfig

pytestmark = pytest.mark.integration
CUDA = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
CODECS = ("int8", "fp32")
NUM_TOKENS = 10  # 3 blocks of 4


class Decode:
    """A decode side on ``device`` with a CUDA IPC pool (on CPU: host memory, for the logic alone)."""

    def __init__(self, device: str = "cpu") -> None:
        self.security = TransferSecurity(token=secrets.token_urlsafe(24))
        model = tiny_model()
        if device != "cpu":
            from workers.disagg_pair import model_on_device
            model = model_on_device(model, device)
        self.engine = Engine(model, None, EngineConfig(block_size=4, kv_cache_bytes=48 * 2048, device=device))
        self.layout = engine_layout(self.engine, CODECS)
        self.receiver = KVReceiver(self.layout, CacheSink(self.engine.cache, staged=True))
        self.receiver.enable_cuda_ipc(IpcPool(self.engine.cache.device, segment_bytes=1 << 20, num_segments=2))
        self.server, port = start_server([kv_transfer_handler(self.receiver)], "127.0.0.1:0", self.security)
        self.target = f"127.0.0.1:{port}"
        self.channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
        self.auth = self.security.call_metadata()
        self.outcomes: dict[str, TransferOutcome] = {}

    def reserve(self, rid: str):
        res = self.engine.reserve(rid, NUM_TOKENS)

        def done(o: TransferOutcome) -> None:
            self.outcomes[rid] = o
            if not o.ok:
                self.engine.release(res)
        self.receiver.expect(rid, res.blocks, done, 20.0)
        return res

    def lease(self, rid: str, min_bytes: int = 1000) -> pb.CudaIpcLease:
        call: Any = self.channel.unary_unary(OPEN_CUDA_IPC_METHOD, request_serializer=None,
                                        response_deserializer=pb.CudaIpcLease.FromString)
        return call(pb.CudaIpcLeaseRequest(request_id=rid, min_bytes=min_bytes).SerializeToString(),
                    metadata=self.auth, timeout=5)

    def push(self, frames: list[bytes]) -> pb.PushAck:
        call: Any = self.channel.stream_unary(PUSH_METHOD, request_serializer=None,
                                         response_deserializer=pb.PushAck.FromString)
        return call(iter(frames), metadata=self.auth, timeout=10)

    def close(self) -> None:
        self.channel.close()
        self.server.stop(0).wait(5)
        self.receiver.stop()


@pytest.fixture
def decode():
    d = Decode()
    yield d
    d.close()
    assert d.receiver.ipc is not None and d.receiver.ipc.leased == 0, "an IPC lease outlived its push"


def _handshake(rid: str, layout, lease: pb.CudaIpcLease, epoch: int | None = None, timeout_ms: int = 0) -> bytes:
    hs = pb.PushHandshake(protocol_version=PROTOCOL_VERSION, request_id=rid, layout=layout.to_proto(),
                          num_tokens=NUM_TOKENS, transport=pb.TRANSPORT_CUDA_IPC, sender_host="test",
                          ipc_epoch=lease.pool_epoch if epoch is None else epoch, ipc_segment=lease.segment,
                          timeout_ms=timeout_ms)
    return encode_control(pb.PushMessage(handshake=hs))


def _assert_landed(d: Decode, blocks, sent: list[tuple[str, torch.Tensor, torch.Tensor]]) -> None:
    """Each layer's reserved blocks hold what its codec makes of the keys and values sent (name, k, v)."""
    for layer, (name, k, v) in enumerate(sent):
        c = get_codec(name)
        got_k, got_v = d.engine.cache.read_tokens(layer, blocks, 12, torch.float32)
        assert torch.equal(got_k.view(k.shape), c.decode(c.encode(k, Kind.KEY), torch.float32))
        assert torch.equal(got_v.view(v.shape), c.decode(c.encode(v, Kind.VALUE), torch.float32))


def _bulk_socket(d: Decode) -> socket.socket:
    """A raw bulk TCP connection to the decode side (ticket from OpenBulk, hello answered OK)."""
    sock, answer = connect(open_bulk(d.channel, d.auth))
    assert answer == OK
    return sock


def _write_chunks(d: Decode, rid: str, segment: torch.Tensor, corrupt: bool = False, first_offset: int = 0):
    """Encode every layer's 3 blocks into the segment, as a mapped sender does; the control frames and the
    sent tensors."""
    frames, sent, stream = [], [], StreamChecksum()
    offset, total = first_offset, 0
    gen = torch.Generator().manual_seed(7)
    for layer, name in enumerate(CODECS):
        c = get_codec(name)
        shape = d.layout.block_shape(3)
        k, v = torch.randn(shape, generator=gen), torch.randn(shape, generator=gen)
        ek, ev = c.encode(k, Kind.KEY), c.encode(v, Kind.VALUE)
        parts = [t.contiguous().view(torch.uint8).reshape(-1) for t in (ek.scales, ek.zeros, ev.scales, ev.zeros,
                                                                         ek.payload, ev.payload) if t is not None]
        data = torch.cat(parts)
        assert data.numel() == chunk_nbytes(c, shape)
        segment[offset:offset + data.numel()].copy_(data)
        checksum = device_checksum(segment[offset:offset + data.numel()])
        if corrupt:
            segment[offset + data.numel() - 1] ^= 1  # flipped after the sender's checksum
        chunk = pb.KVChunk(seq=layer, request_id=rid, layer=layer, first_block=0, num_blocks=3,
                           codec=int(c.codec_id),  # type: ignore[arg-type]  # an int value of the proto Codec enum
                           checksum=checksum, shm=pb.ShmRef(offset=offset, length=data.numel()))
        frames.append(encode_control(pb.PushMessage(chunk=chunk)))
        stream.add(checksum)
        sent.append((name, k, v))
        total += data.numel()
        offset = -(-(offset + data.numel()) // 16) * 16
    finish = pb.PushFinish(num_chunks=len(CODECS), num_bytes=total, checksum=stream.value, first_token=3)
    return frames + [encode_control(pb.PushMessage(finish=finish))], sent


def test_a_leased_segment_lands_by_block_index_and_the_lease_ends_with_the_push(decode: Decode) -> None:
    res = decode.reserve("a")
    lease = decode.lease("a")
    assert lease.pool_epoch == decode.receiver.ipc.epoch and decode.receiver.ipc.leased == 1
    segment = decode.receiver.ipc.segments[lease.segment]
    frames, sent = _write_chunks(decode, "a", segment)
    ack = decode.push([_handshake("a", decode.layout, lease)] + frames)
    assert ack.num_chunks == 2 and decode.outcomes["a"].ok and decode.outcomes["a"].first_token == 3
    _assert_landed(decode, res.blocks, sent)
    assert decode.receiver.ipc.leased == 0
    decode.engine.release(res)


def test_a_stale_epoch_is_refused_as_after_a_restart(decode: Decode) -> None:
    decode.reserve("b")
    lease = decode.lease("b")
    with pytest.raises(grpc.RpcError) as err:
        decode.push([_handshake("b", decode.layout, lease, epoch=lease.pool_epoch ^ 0x10)])
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "stale CUDA IPC mapping" in err.value.details()
    assert not decode.outcomes["b"].ok


def test_a_corrupted_segment_is_refused_by_its_checksum(decode: Decode) -> None:
    decode.reserve("c")
    lease = decode.lease("c")
    frames, _ = _write_chunks(decode, "c", decode.receiver.ipc.segments[lease.segment], corrupt=True)
    with pytest.raises(grpc.RpcError) as err:
        decode.push([_handshake("c", decode.layout, lease)] + frames)
    assert err.value.code() == grpc.StatusCode.DATA_LOSS and "checksum" in err.value.details()


def test_a_segment_rests_after_a_push_that_ended_before_its_finish(decode: Decode) -> None:
    """A push refused mid-stream may still have a chunk's write on its way into the segment (its sender learns
    of the refusal at its next message), so the segment is not leased again until it has rested; a push that
    reached its finish hands its segment straight back."""
    decode.receiver.ipc = pool = IpcPool(torch.device("cpu"), 1 << 20, num_segments=2, quarantine_s=1.0)
    decode.reserve("c")
    lease = decode.lease("c")
    frames, _ = _write_chunks(decode, "c", pool.segments[lease.segment], corrupt=True)
    with pytest.raises(grpc.RpcError) as err:
        decode.push([_handshake("c", decode.layout, lease)] + frames[:1])  # refused at its first chunk
    assert err.value.code() == grpc.StatusCode.DATA_LOSS
    assert pool.leased == 0 and pool.resting == 1
    for rid in ("e1", "e2"):
        decode.reserve(rid)
    other = decode.lease("e1")
    assert other.segment != lease.segment
    with pytest.raises(grpc.RpcError) as err:
        decode.lease("e2")
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "(1 resting after an unfinished push)" in err.value.details()

    frames, _ = _write_chunks(decode, "e1", pool.segments[other.segment])
    decode.push([_handshake("e1", decode.layout, other)] + frames)  # reached its finish: straight back
    assert decode.outcomes["e1"].ok and pool.resting == 1
    assert decode.lease("e2").segment == other.segment
    decode.receiver.cancel("e2")  # expired before its push: rests too
    pool.release_stale(decode.receiver.expectations.__contains__)
    assert pool.resting == 2

    time.sleep(1.1)  # both rested: leased again
    for rid in ("g1", "g2"):
        decode.reserve(rid)
    assert {decode.lease("g1").segment, decode.lease("g2").segment} == {0, 1}
    for rid in ("g1", "g2"):
        decode.receiver.cancel(rid)
    pool.release_stale(decode.receiver.expectations.__contains__)


def test_a_chunk_off_the_segment_alignment_is_refused_by_name(decode: Decode) -> None:
    decode.reserve("a")
    lease = decode.lease("a")
    frames, _ = _write_chunks(decode, "a", decode.receiver.ipc.segments[lease.segment], first_offset=8)
    with pytest.raises(grpc.RpcError) as err:  # bytes and checksum right, but where no sender puts a chunk
        decode.push([_handshake("a", decode.layout, lease)] + frames)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "offset 8 in the IPC segment is not a multiple of 16" in err.value.details()
    assert not decode.outcomes["a"].ok


def test_a_lease_needs_the_token(decode: Decode) -> None:
    decode.reserve("t")
    call: Any = decode.channel.unary_unary(OPEN_CUDA_IPC_METHOD, request_serializer=None,
                                           response_deserializer=pb.CudaIpcLease.FromString)
    for metadata in ((), (("authorization", "Bearer wrong-token"),)):
        with pytest.raises(grpc.RpcError) as err:
            call(pb.CudaIpcLeaseRequest(request_id="t", min_bytes=10).SerializeToString(), metadata=metadata,
                 timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert decode.receiver.ipc.leased == 0
    decode.receiver.cancel("t")


def test_leases_need_a_reservation_and_a_free_segment(decode: Decode) -> None:
    with pytest.raises(grpc.RpcError) as err:
        decode.lease("nobody")
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    for rid in ("d1", "d2", "d3"):
        decode.reserve(rid)
    decode.lease("d1")
    decode.lease("d2")
    with pytest.raises(grpc.RpcError) as err:
        decode.lease("d3")  # two segments, both leased
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "in use" in err.value.details()
    with pytest.raises(grpc.RpcError) as err:
        decode.lease("d3", min_bytes=2 << 20)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "hold 1048576" in err.value.details()
    for rid in ("d1", "d2", "d3"):
        decode.receiver.cancel(rid)
    decode.receiver.ipc.release_stale(decode.receiver.expectations.__contains__)


def test_a_receiver_without_a_pool_refuses_and_auto_senders_fall_back() -> None:
    security = TransferSecurity(token=secrets.token_urlsafe(24))
    engine = Engine(tiny_model(), None, EngineConfig(block_size=4, kv_cache_bytes=48 * 2048))
    receiver = KVReceiver(engine_layout(engine, CODECS), CacheSink(engine.cache))
    server, port = start_server([kv_transfer_handler(receiver)], "127.0.0.1:0", security)
    sender = KVSender(security, transport="cuda_ipc")
    try:
        res = engine.reserve("e", NUM_TOKENS)
        receiver.expect("e", res.blocks, lambda o: None, 10.0)
        with pytest.raises(Exception) as err:
            sender.open_stream(f"127.0.0.1:{port}", "e", engine_layout(engine, CODECS), NUM_TOKENS)
        assert "no CUDA IPC pool" in str(err.value)
    finally:
        sender.close()
        server.stop(0).wait(5)
        receiver.stop()


def test_mappings_of_receivers_not_pushed_to_lately_are_dropped() -> None:
    """A mapping keeps the receiver's memory alive: a long-lived prefill worker whose decode peers are replaced
    (each at a new address) keeps those of the most recent ``max_targets`` only. A host-memory pool in this
    process stands in for the receivers' segments."""
    pool = IpcPool(torch.device("cpu"), 64, num_segments=1)
    lease = pool.lease("r", 8)
    maps = IpcMappings(max_targets=3)
    for target in ("a", "b", "c", "a", "d"):
        assert maps.open(target, lease).data_ptr() == pool.segments[0].data_ptr()
    assert maps.targets == ("c", "a", "d")  # b, pushed to least recently, was dropped
    maps.close()
    assert maps.targets == ()
    pool.release("r")


def test_device_checksum_is_exact_and_sees_every_word() -> None:
    data = torch.randint(0, 256, (1003,), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    padded = data.tolist() + [0] * ((-len(data)) % 4)
    words = [int.from_bytes(bytes(padded[i:i + 4]), "little") for i in range(0, len(padded), 4)]
    want = sum(w * (2 * ((i * 0x9E3779B1) & 0xFFFFFFFF) + 1) for i, w in enumerate(words)) % 2**64
    assert device_checksum(data) == want ^ ((1003 * 0xC2B2AE3D27D4EB4F) % 2**64)
    for i in (0, 500, 1002):
        bad = data.clone()
        bad[i] ^= 0x40
        assert device_checksum(bad) != device_checksum(data)


def test_the_janitor_leaves_a_lease_whose_push_is_still_open_to_that_push() -> None:
    """A request can be over (expired, cancelled, its finish already counted) while its stream is still open
    and its sender maybe writing: the lease it holds ends with the stream, so its rest starts only then."""
    pool = IpcPool(torch.device("cpu"), 64, num_segments=2, quarantine_s=60.0)
    named = pool.lease("in-push", 8)
    pool.lease("never-pushed", 8)
    pool.check("in-push", named.pool_epoch, named.segment)  # a handshake named it
    pool.release_stale(lambda rid: False)  # neither request is alive any more
    assert pool.leased == 1 and pool.resting == 1  # only the lease no push took was released (and rests)
    pool.release("in-push", clean=True)  # its push reached its finish
    assert pool.leased == 0 and pool.resting == 1 and pool.lease("next", 8).segment == named.segment


def test_pool_epochs_differ_and_mappings_need_cuda() -> None:
    a, b = IpcPool(torch.device("cpu"), 64, 1), IpcPool(torch.device("cpu"), 64, 1)
    assert a.epoch != b.epoch
    lease = a.lease("x", 10)
    with pytest.raises(IpcError, match="stale"):
        b.check("x", lease.pool_epoch, 0)
    assert IpcMappings().open("t", lease) is a.segments[0]  # a pool of this process: used as it is
    if not torch.cuda.is_available():
        foreign = pb.CudaIpcLease()
        foreign.CopyFrom(lease)
        foreign.pool_epoch = lease.pool_epoch ^ 0x2  # another process's pool
        with pytest.raises(IpcError, match="needs CUDA"):
            IpcMappings().open("t", foreign)


@pytest.mark.parametrize("control", ["bulk", "grpc"])
@pytest.mark.parametrize("how", ["send_layer", "send_blocks"])
def test_a_sender_pushes_through_a_leased_segment(decode: Decode, how: str, control: str) -> None:
    """KVSender over cuda_ipc, its receiver in this process (so on CPU the pool is host memory and nothing
    is mapped): lease, encode into the segment, device checksum, land by block index, lease released. The
    control messages go over the receiver's bulk TCP connection when it has a listener (as for shm: a gRPC
    stream per push costs more than a small push's data), and on the Push stream when it has none."""
    if control == "bulk":
        decode.receiver.enable_bulk("127.0.0.1")
    res = decode.reserve(how)
    sender = KVSender(decode.security, transport="cuda_ipc", shm_chunk_bytes=1500)  # several chunks a layer
    gen = torch.Generator().manual_seed(11)
    sent = []
    try:
        stream = sender.open_stream(decode.target, how, decode.layout, NUM_TOKENS)
        for layer in range(decode.layout.num_layers):
            k, v = (torch.randn(decode.layout.block_shape(3), generator=gen) for _ in range(2))
            if how == "send_layer":
                stream.send_layer(layer, 0, k, v)
            else:
                stream.send_blocks(layer, 0, k, v, torch.arange(3))
            sent.append((k, v))
        result = stream.finish(4)
        # the connection that carried the control messages is back in the sender's pool (bulk), or none was made
        assert sender.bulk.idle(decode.target) == (1 if control == "bulk" else 0)
        assert sender.bulk_control_usable(decode.target) == (control == "bulk")
    finally:
        sender.close()
    assert result.transport == "cuda_ipc" and result.num_chunks > decode.layout.num_layers
    assert decode.outcomes[how].ok and decode.receiver.ipc.leased == 0
    _assert_landed(decode, res.blocks, [(name, k, v) for name, (k, v) in zip(CODECS, sent)])
    decode.engine.release(res)


def test_a_lease_asked_for_on_the_bulk_connection_serves_the_push_on_it(decode: Decode) -> None:
    """A cuda_ipc sender asks for its segment on the bulk connection that then carries the push's control
    messages (no OpenCudaIpc RPC). Refusals come back by name, as OpenCudaIpc's would, and leave the
    connection usable."""
    decode.receiver.enable_bulk("127.0.0.1")
    res = decode.reserve("bl")
    with _bulk_socket(decode) as sock:
        refusals = ((lease_request("nobody", 1000), grpc.StatusCode.NOT_FOUND, "no reservation for request 'nobody'"),
                    (b"\xff\xff\xff", grpc.StatusCode.INVALID_ARGUMENT, "malformed CudaIpcLeaseRequest"),
                    (lease_request("bl", 2 << 20), grpc.StatusCode.RESOURCE_EXHAUSTED, "hold 1048576"))
        for request, code, says in refusals:
            sock.sendall(frame(KIND_LEASE, request))
            refused = pb.CudaIpcLeaseResult.FromString(read_message(sock, KIND_LEASE_RESULT))
            assert refused.code == code.value[0] and says in refused.message, refused
            assert decode.receiver.ipc.leased == 0
        sock.sendall(frame(KIND_LEASE, lease_request("bl", 1000)))
        got = pb.CudaIpcLeaseResult.FromString(read_message(sock, KIND_LEASE_RESULT))
        assert got.code == 0 and got.lease.pool_epoch == decode.receiver.ipc.epoch
        assert decode.receiver.ipc.leased == 1
        frames, sent = _write_chunks(decode, "bl", decode.receiver.ipc.segments[got.lease.segment])
        sock.sendall(frame(KIND_HANDSHAKE, _handshake("bl", decode.layout, got.lease, timeout_ms=10_000))
                     + b"".join(frame(KIND_CHUNK, f) for f in frames[:-1]) + frame(KIND_FINISH, frames[-1]))
        result = pb.PushResult.FromString(read_message(sock, KIND_RESULT))
    assert result.code == 0 and result.ack.num_chunks == 2, result
    assert decode.outcomes["bl"].ok and decode.receiver.ipc.leased == 0
    _assert_landed(decode, res.blocks, sent)
    decode.engine.release(res)


def test_a_refused_lease_on_the_bulk_connection_hands_the_connection_back(decode: Decode) -> None:
    """Both segments leased: the sender's lease on its bulk connection is refused with OpenCudaIpc's code
    (``auto`` falls back on it), and the connection, clean, goes back to the sender's pool."""
    decode.receiver.enable_bulk("127.0.0.1")
    for rid in ("x1", "x2", "x3"):
        decode.reserve(rid)
    decode.lease("x1")
    decode.lease("x2")
    sender = KVSender(decode.security, transport="cuda_ipc")
    try:
        with pytest.raises(TransferFailed) as err:
            sender.open_stream(decode.target, "x3", decode.layout, NUM_TOKENS)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and "in use" in err.value.message
        assert sender.bulk.idle(decode.target) == 1 and sender.bulk_control_usable(decode.target)
    finally:
        sender.close()
    for rid in ("x1", "x2", "x3"):
        decode.receiver.cancel(rid)
    decode.receiver.ipc.release_stale(decode.receiver.expectations.__contains__)


@pytest.mark.parametrize("busy", ["every segment leased", "the push larger than a segment"])
def test_auto_falls_back_for_one_push_when_the_segments_cannot_take_it(decode: Decode, busy: str) -> None:
    """A push the receiver's segments cannot take now (all leased, or too large for one) goes over another
    transport, and the next push to that receiver still asks for a segment: a busy moment, or one long
    prompt, must not turn CUDA IPC off for everyone (only a receiver without a pool, or one this process
    cannot map, does). The sender says its cache is on CUDA (only its transport choice reads that)."""
    decode.receiver.enable_bulk("127.0.0.1")
    pool = decode.receiver.ipc
    assert pool is not None
    if busy == "every segment leased":
        for rid in ("x1", "x2"):
            decode.reserve(rid)
            decode.lease(rid)
    else:
        decode.receiver.ipc = IpcPool(torch.device("cpu"), 256, num_segments=1)  # smaller than this push
    decode.reserve("one")
    sender = KVSender(decode.security, transport="auto", device="cuda")
    try:
        assert sender.choose_transport(decode.target) == "cuda_ipc"
        stream = sender.open_stream(decode.target, "one", decode.layout, NUM_TOKENS)
        assert stream.transport == "shm"
        stream.cancel("test")
        assert sender.ipc_control.usable(decode.target) and sender.choose_transport(decode.target) == "cuda_ipc"
    finally:
        sender.close()
        decode.receiver.ipc = pool
    for rid in ("x1", "x2", "one"):
        decode.receiver.cancel(rid)
    pool.release_stale(decode.receiver.expectations.__contains__)
    assert pool.leased == 0


@pytest.mark.parametrize("receiver", ["older", "connection breaks"])
def test_a_receiver_that_gives_no_lease_on_its_bulk_connection_still_gets_the_push(
        decode: Decode, caplog: pytest.LogCaptureFixture, receiver: str) -> None:
    """A receiver from before leases on the bulk connection answers one as a push that did not open with a
    handshake, and ends the connection. The sender closes it, leases with OpenCudaIpc, sends this push's
    control on gRPC, says so once, and stops asking that receiver for a connection for a while. A
    connection that breaks instead costs only this push its bulk path."""
    real = decode.receiver.serve_bulk

    def serve_as_before(conn: BulkConnection) -> None:
        if receiver == "connection breaks":
            conn.close()
            return
        try:
            conn.read_message((KIND_HANDSHAKE,))
        except BulkError as exc:  # what serve_bulk answered then to any other first message
            if exc.kind == "protocol":
                conn.send_frame(KIND_RESULT, [pb.PushResult(code=grpc.StatusCode.INVALID_ARGUMENT.value[0],
                                                            message=f"a push must open with a handshake: {exc}")
                                              .SerializeToString()])
                conn.drain(1.0)
            return
        raise AssertionError("the sender opened with a handshake, not a lease")

    decode.receiver.serve_bulk = serve_as_before  # type: ignore[method-assign]  # the listener serves with it
    decode.receiver.enable_bulk("127.0.0.1")
    decode.receiver.serve_bulk = real  # type: ignore[method-assign]
    res = decode.reserve("old")
    sender = KVSender(decode.security, transport="cuda_ipc")
    k = torch.randn(decode.layout.block_shape(3), generator=torch.Generator().manual_seed(3))
    try:
        with caplog.at_level("WARNING", logger="kvtransfer.stream_context"):
            stream = sender.open_stream(decode.target, "old", decode.layout, NUM_TOKENS)
            for layer in range(decode.layout.num_layers):
                stream.send_layer(layer, 0, k, k)
            result = stream.finish(4)
        assert result.transport == "cuda_ipc" and decode.outcomes["old"].ok
        assert sender.bulk.idle(decode.target) == 0
        said = [r.getMessage() for r in caplog.records if "no CUDA IPC lease on its bulk connection" in r.getMessage()]
        assert sender.bulk_control_usable(decode.target) == (receiver == "connection breaks")
        assert len(said) == (1 if receiver == "older" else 0), said
    finally:
        sender.close()
    got, _ = decode.engine.cache.read_tokens(1, res.blocks, 12, torch.float32)  # layer 1: fp32, exact
    assert torch.equal(got.view(k.shape), k)
    decode.engine.release(res)


# ---------------------------------------------------------------------------------------------- CUDA
@CUDA
@pytest.mark.cuda
@pytest.mark.parametrize("control", ["bulk", "grpc"])
def test_cuda_sender_maps_the_segment_and_a_restarted_receiver_is_mapped_afresh(control: str) -> None:
    first = Decode("cuda")
    if control == "bulk":  # the lease and the control messages on the bulk connection
        first.receiver.enable_bulk("127.0.0.1")
    sender = KVSender(first.security, transport="cuda_ipc", device="cuda")
    try:
        res = first.reserve("g1")
        stream = sender.open_stream(first.target, "g1", first.layout, NUM_TOKENS)
        gen = torch.Generator().manual_seed(3)
        for layer in range(first.layout.num_layers):
            k, v = (torch.randn(first.layout.block_shape(3), generator=gen).cuda() for _ in range(2))
            stream.send_layer(layer, 0, k, v)
        assert stream.finish(5).num_chunks >= 2 and first.outcomes["g1"].ok
        assert sender.bulk.idle(first.target) == (1 if control == "bulk" else 0)
        first.engine.release(res)
        old_epoch = first.receiver.ipc.epoch
        # "restart": a new receiver (new pool, new epoch); a handshake with the old epoch is refused
        second = Decode("cuda")
        try:
            second.reserve("g2")
            lease = second.lease("g2")
            assert lease.pool_epoch != old_epoch
            with pytest.raises(grpc.RpcError) as err:
                second.push([_handshake("g2", second.layout, lease, epoch=old_epoch)])
            assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        finally:
            second.close()
    finally:
        sender.close()
        first.close()
