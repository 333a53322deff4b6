"""The bulk TCP transport against a real gRPC server and real sockets: tickets and credentials, connection
reuse, and every way a push on it can break. Each refused push must end with a result naming the
problem, release the reservation, write nothing it should not, close the connection it used, and leave
the receiver serving the next push."""

from __future__ import annotations

import socket
import ssl
import time
from collections.abc import Callable
from pathlib import Path

import grpc
import pytest
import torch

from kvtransfer.auth import TransferSecurity
from kvtransfer.bulk import FRAME, HELLO, KEEPALIVE_IDLE_S, KIND_CHUNK, KIND_FINISH, KIND_HANDSHAKE, KIND_RESULT, OK
from kvtransfer.bulk_listener import BulkListener
from kvtransfer.cuda_ipc import IpcPool
from kvtransfer.errors import TransferFailed
from kvtransfer.sender import KVSender
from kvtransfer.wire import encode_control, pb

from kv_helpers import (  # noqa: F401  (fixtures)
    AUTH,
    SECURITY,
    Frames,
    OpenPush,
    Pending,
    Rig,
    connect,
    frame,
    make_pki,
    make_rig,
    model,
    open_bulk,
    read_message,
    wait_until,
)

pytestmark = [pytest.mark.integration]

Code = grpc.StatusCode


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    rig = make_rig()
    rig.receiver.start_janitor(0.05)
    return rig


def send_good_with(rig: Rig, transport: str, pending: Pending | None = None) -> None:
    """A good push from a fresh sender on ``transport``, closed afterwards."""
    sender = KVSender(SECURITY, transport=transport)  # type: ignore[arg-type]  # parametrized as str
    try:
        rig.send_good(pending or rig.reserve(), sender)
    finally:
        sender.close()


def bulk_push(rig: Rig, rid: str, *, timeout: float = 10.0) -> tuple[socket.socket, Frames]:
    """A raw push on the tcp transport, its handshake sent; the caller writes the rest."""
    ticket = open_bulk(rig.channel)
    sock, answer = connect(ticket)
    assert answer == OK
    frames = Frames(rig.layout, rid)
    sock.sendall(frame(KIND_HANDSHAKE, frames.handshake(transport=pb.TRANSPORT_TCP, timeout_ms=int(timeout * 1e3))))
    return sock, frames


def read_result(sock: socket.socket, timeout: float = 5.0) -> pb.PushResult:
    """The receiver's PushResult, the one message it writes per push."""
    return pb.PushResult.FromString(read_message(sock, KIND_RESULT, timeout))


def assert_closed_after_result(sock: socket.socket) -> None:
    """The receiver wrote nothing more and ends the connection once this side closes its half."""
    sock.shutdown(socket.SHUT_WR)
    sock.settimeout(5)
    try:
        assert sock.recv(1) == b""
    except ConnectionResetError:
        pass


def first_layer_landed(rig: Rig, sender: KVSender, pending: Pending,
                       timeout_s: float = 10):
    """A push opened for ``pending`` whose layer 0 has landed: (the stream, the blocks it sent)."""
    n = rig.layout.blocks_for(pending.reservation.num_tokens)
    stream = sender.open_stream(rig.target, pending.rid, rig.layout, pending.reservation.num_tokens,
                                timeout_s=timeout_s)
    k = torch.randn(rig.layout.block_shape(n))
    landed = len(rig.sink.writes)
    stream.send_layer(0, 0, k, k.clone())
    rig.sink.wait_for(landed + 1)
    return stream, k


# ---------------------------------------------------------------------- good pushes
@pytest.mark.parametrize("transport", ["tcp", "shm"])
def test_pushes_on_the_bulk_connection_land_exactly_and_reuse_it(rig: Rig, transport: str) -> None:
    """tcp pushes travel whole over one reused bulk connection; shm pushes send only their control on it
    (handshake, chunk offsets, finish: no gRPC call per push), the bytes staying in the segment. Each
    push's result comes back on the connection."""
    chunking = {"bulk_chunk_bytes": 300} if transport == "tcp" else {"shm_chunk_bytes": 300}
    sender = KVSender(SECURITY, transport=transport, **chunking)  # type: ignore[arg-type]  # parametrized as str; several chunks a layer
    try:
        for _ in range(3):
            result = rig.send_good(rig.reserve(), sender)  # checks every landed value
            assert result.transport == transport and result.num_chunks > rig.layout.num_layers
        assert rig.receiver.bulk is not None and rig.receiver.bulk.connections == 1
        assert sender.bulk.idle(rig.target) == 1
        if transport == "shm":
            assert sender.segments.idle == 1
        # both ends probe an idle connection, so a vanished peer host does not hold it (and its thread) for good
        ends = [c.sock for c in sender.bulk._idle[rig.target]] + [c.sock for c in rig.receiver.bulk._open.values()]
        assert len(ends) == 2
        for sock in ends:
            assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) == 1
            assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE) == KEEPALIVE_IDLE_S
    finally:
        sender.close()
    wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the closed sender's connection to end")
    rig.assert_clean()


def test_shm_control_falls_back_to_grpc_without_a_listener(make_rig: Callable[..., Rig],
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A receiver with no bulk listener still takes shared-memory pushes, their control on the gRPC Push
    stream; the sender says so once and stops asking for a connection for a while."""
    rig = make_rig()
    assert rig.receiver.bulk is not None
    rig.receiver.bulk.close()
    rig.receiver.bulk = None  # as a receiver that never enabled it
    sender = KVSender(SECURITY, transport="shm")
    try:
        with caplog.at_level("WARNING", logger="kvtransfer.sender"):
            for _ in range(2):
                assert rig.send_good(rig.reserve(), sender).transport == "shm"
        assert not sender.bulk_control_usable(rig.target) and sender.bulk.idle(rig.target) == 0
        said = [r.getMessage() for r in caplog.records if "gave no bulk TCP connection" in r.getMessage()]
        assert len(said) == 1 and "no bulk TCP listener" in said[0], said
    finally:
        sender.close()
    rig.assert_clean()


def shm_push(rig: Rig, rid: str, segment_name: str, segment_size: int) -> tuple[socket.socket, Frames]:
    """A raw shared-memory push on a bulk connection, its handshake sent; the caller writes the rest."""
    ticket = open_bulk(rig.channel)
    sock, answer = connect(ticket)
    assert answer == OK
    frames = Frames(rig.layout, rid)
    sock.sendall(frame(KIND_HANDSHAKE, frames.handshake(transport=pb.TRANSPORT_SHARED_MEMORY, timeout_ms=10_000,
                                                         shm_name=segment_name, shm_size=segment_size)))
    return sock, frames


@pytest.mark.parametrize("case", ["no such segment", "bytes in the frame", "a frame over 64 KiB",
                                  "offset outside the segment"])
def test_bad_shm_pushes_on_the_bulk_connection_are_refused_by_name(rig: Rig, case: str) -> None:
    from kvtransfer.shm import SharedSegment

    pending = rig.reserve()
    segment = SharedSegment.create(4096)
    name = "epd-kv-1-" + "0" * 32 if case == "no such segment" else segment.name
    expect = {"no such segment": (Code.FAILED_PRECONDITION, "shared-memory transport unavailable"),
              "bytes in the frame": (Code.INVALID_ARGUMENT, "inline bytes on a shared-memory stream"),
              "a frame over 64 KiB": (Code.INVALID_ARGUMENT, "bulk message of"),
              "offset outside the segment": (Code.OUT_OF_RANGE, "outside the 4096-byte segment")}[case]
    try:
        sock, frames = shm_push(rig, pending.rid, name, segment.size)
        with sock:
            if case == "bytes in the frame":  # a tcp-style chunk on a shm push
                sock.sendall(frame(KIND_CHUNK, frames.chunk(0)))
            elif case == "a frame over 64 KiB":
                sock.sendall(FRAME.pack(KIND_CHUNK, 64 * 2**10 + 1))
            elif case == "offset outside the segment":
                chunk = pb.KVChunk(seq=0, request_id=pending.rid, layer=0, first_block=0,
                                   num_blocks=frames.num_blocks, codec=pb.CODEC_FP32,
                                   shm=pb.ShmRef(offset=1024, length=10**6))
                sock.sendall(frame(KIND_CHUNK, encode_control(pb.PushMessage(chunk=chunk))))
            result = read_result(sock)
            assert result.code == expect[0].value[0] and expect[1] in result.message, result
            assert_closed_after_result(sock)
    finally:
        segment.close()
    rig.assert_failed(pending, expect[0], expect[1])
    assert rig.sink.writes == []
    wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the connection to be closed")
    send_good_with(rig, "shm")  # the receiver serves the next shm push
    rig.assert_clean()


def test_a_hand_written_push_over_the_bulk_connection_is_acknowledged(rig: Rig) -> None:
    pending = rig.reserve("by-hand")
    sock, frames = bulk_push(rig, "by-hand")
    with sock:
        sock.sendall(b"".join(frame(KIND_CHUNK, c) for c in frames.all_layers()))
        sock.sendall(frame(KIND_FINISH, frames.finish(first_token=11)))
        result = read_result(sock)
        assert result.code == 0 and result.message == ""
        ack = result.ack
        assert (ack.num_chunks, ack.num_bytes, ack.checksum) == (frames.seq, frames.nbytes, frames.checksum.value)
        outcome = pending.outcome()
        assert outcome.ok and outcome.first_token == 11
        # the connection carries the next push
        second = rig.reserve("by-hand-2")
        again = Frames(rig.layout, "by-hand-2")
        sock.sendall(frame(KIND_HANDSHAKE, again.handshake(transport=pb.TRANSPORT_TCP, timeout_ms=10_000)))
        sock.sendall(b"".join(frame(KIND_CHUNK, c) for c in again.all_layers()))
        sock.sendall(frame(KIND_FINISH, again.finish(first_token=12)))
        assert read_result(sock).code == 0 and second.outcome().first_token == 12
        assert rig.engine.release(second.reservation)
    assert rig.engine.release(pending.reservation)
    rig.assert_clean()


# ---------------------------------------------------------------------- credentials and tickets
def test_open_bulk_needs_the_token(rig: Rig) -> None:
    for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),)):
        with pytest.raises(grpc.RpcError) as err:
            open_bulk(rig.channel, metadata)
        assert err.value.code() == Code.UNAUTHENTICATED
    assert rig.receiver.bulk is not None and rig.receiver.bulk.connections == 0


@pytest.mark.parametrize("case", ["grpc transport", "no deadline", "not a handshake", "junk", "a chunk first"])
def test_a_push_on_the_connection_must_open_with_a_tcp_handshake(rig: Rig, case: str) -> None:
    """A connection's first message must be a TRANSPORT_TCP handshake with a deadline. Anything else
    gets a result naming the problem (the reservation, where one was named, is released) and the
    connection ends; the receiver then serves a good push."""
    pending = rig.reserve(f"hs-{case.replace(' ', '-')}")
    frames = Frames(rig.layout, pending.rid)
    message, expect = {
        "grpc transport": (frame(KIND_HANDSHAKE, frames.handshake(timeout_ms=5000)), "must say TRANSPORT_TCP"),
        "no deadline": (frame(KIND_HANDSHAKE, frames.handshake(transport=pb.TRANSPORT_TCP)), "must carry timeout_ms"),
        "not a handshake": (frame(KIND_HANDSHAKE, frames.finish()), "must open with a handshake"),
        "junk": (frame(KIND_HANDSHAKE, b"\xff\xff\xff"), "malformed message"),
        "a chunk first": (frame(KIND_CHUNK, frames.chunk(0)), "must open with a handshake"),
    }[case]
    ticket = open_bulk(rig.channel)
    sock, answer = connect(ticket)
    with sock:
        assert answer == OK
        sock.sendall(message)
        result = read_result(sock)
        assert result.code == Code.INVALID_ARGUMENT.value[0] and expect in result.message, result
        assert_closed_after_result(sock)
    if case in ("grpc transport", "no deadline"):  # these named the reservation: it is released
        rig.assert_failed(pending, Code.INVALID_ARGUMENT, expect)
    else:
        assert not pending.done.is_set()
        send_good_with(rig, "tcp", pending)
    wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the connection to be closed")
    rig.good_transfer()
    rig.assert_clean()


def test_push_with_a_tcp_handshake_is_refused_by_name(rig: Rig) -> None:
    """A tcp push travels whole over its connection; a Push stream saying TRANSPORT_TCP is refused and
    its reservation released."""
    pending = rig.reserve()
    push = OpenPush(rig.channel, AUTH)
    push.send(Frames(rig.layout, pending.rid).handshake(transport=pb.TRANSPORT_TCP))
    err = push.error()
    assert err.code() == Code.INVALID_ARGUMENT and "travels whole over its bulk TCP connection" in err.details()
    push.end()
    rig.assert_failed(pending, Code.INVALID_ARGUMENT, "travels whole over its bulk TCP connection")
    rig.good_transfer()
    rig.assert_clean()


def test_a_wrong_or_reused_secret_is_turned_away(rig: Rig) -> None:
    ticket = open_bulk(rig.channel)
    bad, answer = connect(ticket, secret=bytes(32))
    bad.close()
    assert answer == b""  # closed without a word
    # the failed attempt used the ticket up: the right secret no longer opens anything
    late, answer = connect(ticket)
    late.close()
    assert answer == b""
    good_ticket = open_bulk(rig.channel)
    good, answer = connect(good_ticket)
    assert answer == OK
    again, answer = connect(good_ticket)  # a ticket opens one connection only
    again.close()
    assert answer == b""
    good.close()
    rig.good_transfer()


def test_a_silent_connection_is_dropped_after_the_hello_timeout() -> None:
    listener = BulkListener("127.0.0.1", lambda conn: None, hello_timeout_s=0.3)
    try:
        sock = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        start = time.monotonic()
        assert sock.recv(1) == b""  # the receiver hung up
        assert time.monotonic() - start < 3
        sock.close()
        assert listener.connections == 0
    finally:
        listener.close()


def test_under_mtls_the_connection_runs_tls_and_needs_a_certificate(make_rig: Callable[..., Rig],
                                                                     tmp_path: Path) -> None:
    pki, other = make_pki(tmp_path / "pki", "epd"), make_pki(tmp_path / "other", "rogue")
    server = TransferSecurity(tls_ca=pki.ca, tls_cert=pki.server_cert, tls_key=pki.server_key)
    client = TransferSecurity(tls_ca=pki.ca, tls_cert=pki.client_cert, tls_key=pki.client_key)
    rig = make_rig(server_security=server, client_security=client)
    sender = KVSender(client, transport="tcp")
    try:
        for _ in range(2):
            assert rig.send_good(rig.reserve(), sender).transport == "tcp"
        assert rig.receiver.bulk is not None and rig.receiver.bulk.connections == 1
        # a push the receiver cancels halfway: over TLS the sender learns it with its result, by name
        pending = rig.reserve()
        stream, k = first_layer_landed(rig, sender, pending)
        assert rig.receiver.cancel(pending.rid, "the request was aborted")
        with pytest.raises(TransferFailed) as info:
            for layer in range(1, rig.layout.num_layers):
                stream.send_layer(layer, 0, k.clone(), k.clone())
            stream.finish(1)
        assert info.value.code == Code.CANCELLED and "the request was aborted" in info.value.message
        assert rig.send_good(rig.reserve(), sender).transport == "tcp"  # on a fresh connection
    finally:
        sender.close()
    shm = KVSender(client, transport="shm")  # its control on a TLS bulk connection of its own
    try:
        assert rig.send_good(rig.reserve(), shm).transport == "shm"
        assert shm.bulk.idle(rig.target) == 1 and shm.bulk.ssl_context is not None
    finally:
        shm.close()
    rig.receiver.enable_cuda_ipc(IpcPool(torch.device("cpu"), 1 << 20, num_segments=2))  # host pool: no GPU
    ipc = KVSender(client, transport="cuda_ipc")  # its lease and control on a TLS bulk connection
    try:
        for _ in range(2):
            assert rig.send_good(rig.reserve(), ipc).transport == "cuda_ipc"
        assert ipc.bulk.idle(rig.target) == 1 and ipc.bulk_control_usable(rig.target)
    finally:
        ipc.close()
    with client.open_channel(rig.target) as channel:
        ticket = open_bulk(channel, metadata=())  # mTLS is the credential: no token
    rogue = TransferSecurity(tls_ca=pki.ca, tls_cert=other.client_cert, tls_key=other.client_key)
    no_cert = ssl.create_default_context(cafile=str(pki.ca))
    attempts = {"plaintext": None, "no client certificate": no_cert,
                "certificate from another CA": rogue.ssl_context(server_side=False)}
    for name, ctx in attempts.items():
        sock = socket.create_connection(("127.0.0.1", ticket.port), timeout=5)
        try:
            if ctx is not None:
                sock = ctx.wrap_socket(sock, server_hostname="127.0.0.1")
            sock.sendall(HELLO + ticket.connection_id + ticket.secret)
            answer = sock.recv(1)
        except (ssl.SSLError, ConnectionError):
            answer = b""
        finally:
            sock.close()
        assert answer == b"", name  # turned away before the ticket was read
    good_ctx = client.ssl_context(server_side=False)
    assert good_ctx is not None
    with good_ctx.wrap_socket(socket.create_connection(("127.0.0.1", ticket.port), timeout=5),
                              server_hostname="127.0.0.1") as good:
        good.sendall(HELLO + ticket.connection_id + ticket.secret)
        assert good.recv(1) == OK  # the ticket survived the failed attempts: none of them reached it
    rig.assert_clean()


def test_a_receiver_without_a_listener_refuses_by_name(make_rig: Callable[..., Rig]) -> None:
    rig = make_rig()
    assert rig.receiver.bulk is not None
    rig.receiver.bulk.close()
    rig.receiver.bulk = None  # as a receiver that never enabled it
    pending = rig.reserve()
    sender = KVSender(SECURITY, transport="tcp")
    try:
        with pytest.raises(TransferFailed, match="no bulk TCP listener"):
            sender.open_stream(rig.target, pending.rid, rig.layout, pending.reservation.num_tokens)
    finally:
        sender.close()
    assert not pending.done.is_set()  # nothing reached the reservation: it still waits for a push
    send_good_with(rig, "grpc", pending)


# ---------------------------------------------------------------------- broken streams
@pytest.mark.parametrize("case", ["corrupted", "out of order", "oversized", "unknown kind", "a second handshake",
                                  "truncated", "kind mismatch"])
def test_bad_bulk_frames_are_refused_and_the_connection_closed(rig: Rig, case: str) -> None:
    pending = rig.reserve()
    sock, frames = bulk_push(rig, pending.rid)
    expect = {"corrupted": (Code.DATA_LOSS, "checksum mismatch"),
              "out of order": (Code.INVALID_ARGUMENT, "out of order"),
              "oversized": (Code.INVALID_ARGUMENT, "bulk message of"),
              "unknown kind": (Code.INVALID_ARGUMENT, "kind 9"),
              "a second handshake": (Code.INVALID_ARGUMENT, "kind 1"),
              "truncated": (Code.CANCELLED, "closed before the finish"),
              "kind mismatch": (Code.INVALID_ARGUMENT, "in a bulk frame of kind 3")}[case]
    with sock:
        if case == "corrupted":
            sock.sendall(frame(KIND_CHUNK, frames.chunk(0, edit_payload=lambda p: p[:-1] + bytes([p[-1] ^ 1]))))
        elif case == "out of order":
            frames.seq = 1
            sock.sendall(frame(KIND_CHUNK, frames.chunk(0)))
        elif case == "oversized":
            sock.sendall(FRAME.pack(KIND_CHUNK, 2**31))
        elif case == "unknown kind":
            sock.sendall(FRAME.pack(9, 10) + bytes(10))
        elif case == "a second handshake":
            sock.sendall(frame(KIND_HANDSHAKE, frames.handshake(transport=pb.TRANSPORT_TCP, timeout_ms=5000)))
        elif case == "truncated":
            data = frame(KIND_CHUNK, frames.chunk(0))
            sock.sendall(data[:len(data) // 2])
            sock.shutdown(socket.SHUT_WR)  # the sender goes away mid-frame
        else:
            sock.sendall(frame(KIND_FINISH, frames.chunk(0)))
        if case == "truncated":  # its result goes nowhere: the sender has gone
            wait_until(pending.done.is_set, 5, "the reservation to be released")
        else:
            result = read_result(sock)
            assert result.code == expect[0].value[0] and expect[1] in result.message, result
            assert_closed_after_result(sock)  # nothing of the connection is reused
    rig.assert_failed(pending, expect[0], expect[1])
    assert rig.sink.writes == []
    wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the connection to be closed")
    rig.assert_clean()
    rig.good_transfer()
    send_good_with(rig, "tcp")
    rig.assert_clean()


def test_a_stalled_sender_hits_the_deadline_and_frees_the_reservation(rig: Rig) -> None:
    pending = rig.reserve()
    sock, frames = bulk_push(rig, pending.rid, timeout=1.0)
    with sock:
        sock.sendall(frame(KIND_CHUNK, frames.chunk(0)))  # one layer, then silence
        start = time.monotonic()
        result = read_result(sock, timeout=5)
        assert result.code == Code.DEADLINE_EXCEEDED.value[0] and "deadline passed" in result.message, result
        wait_until(pending.done.is_set, 3, "the reservation to be released")
        assert time.monotonic() - start < 3
    outcome = pending.outcome()
    assert not outcome.ok and outcome.code == Code.DEADLINE_EXCEEDED, outcome
    assert rig.engine.release(pending.reservation) is False
    wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the connection to be closed")
    rig.good_transfer()
    rig.assert_clean()


def test_a_stalled_push_ends_at_its_reservations_deadline_whatever_its_own(rig: Rig) -> None:
    """A handshake asking for 49 days (timeout_ms 2^32 - 1), then silence: the push ends with the
    reservation (1 s) and the sender reads why, instead of the connection and a stream slot being held."""
    pending = rig.reserve(timeout_s=1.0)
    sock, frames = bulk_push(rig, pending.rid, timeout=(2**32 - 1) / 1e3)
    with sock:
        result = read_result(sock, timeout=15)
        assert result.code == Code.DEADLINE_EXCEEDED.value[0], result
    outcome = pending.outcome()
    assert not outcome.ok and outcome.code == Code.DEADLINE_EXCEEDED, outcome
    wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the connection to be closed")
    rig.good_transfer()
    rig.assert_clean()


def test_the_senders_deadline_cap_holds_whatever_the_caller_asks(rig: Rig) -> None:
    """transfer.timeout_s reaches the prefill worker's sender as its cap: a push asked for 10 s that stalls
    after its first layer fails at the cap's 1 s, not at 10, and the reservation is freed."""
    pending = rig.reserve()
    sender = KVSender(SECURITY, transport="tcp", max_timeout_s=1.0)
    try:
        stream, _ = first_layer_landed(rig, sender, pending, timeout_s=10)
        assert stream.deadline - stream.started == pytest.approx(1.0)
        start = time.monotonic()
        wait_until(pending.done.is_set, 5, "the receiver's deadline to free the reservation")
        assert time.monotonic() - start < 3
        outcome = pending.outcome()  # whichever side's deadline acts first: the sender's closes the connection
        assert not outcome.ok and outcome.code in (Code.DEADLINE_EXCEEDED, Code.CANCELLED), outcome
    finally:
        sender.close()
    rig.good_transfer()
    rig.assert_clean()


def test_a_sender_cancel_mid_stream_frees_both_sides(rig: Rig) -> None:
    pending = rig.reserve()
    sender = KVSender(SECURITY, transport="tcp")
    try:
        stream, _ = first_layer_landed(rig, sender, pending)
        stream.cancel("the request was aborted")
        wait_until(pending.done.is_set, 5, "the reservation to be released")
        outcome = pending.outcome()
        assert not outcome.ok and outcome.code in (Code.CANCELLED, Code.DATA_LOSS), outcome
        assert rig.engine.release(pending.reservation) is False
        wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the cancelled stream's connection to close")
        rig.send_good(rig.reserve(), sender)  # the sender opens a fresh connection and carries on
    finally:
        sender.close()
    rig.assert_clean()


def test_a_receiver_stopping_mid_push_fails_it_at_once_on_both_sides(make_rig: Callable[..., Rig]) -> None:
    """The decode worker shuts down while a push is in flight: the reservation fails by name, and the
    sender's next call fails within moments, not at its 30 s deadline."""
    rig = make_rig()
    pending = rig.reserve()
    sender = KVSender(SECURITY, transport="tcp")
    try:
        stream, k = first_layer_landed(rig, sender, pending, timeout_s=30)
        rig.receiver.stop()
        outcome = pending.outcome()
        assert not outcome.ok and outcome.code == Code.UNAVAILABLE and "shutting down" in (outcome.error or "")
        start = time.monotonic()
        with pytest.raises(TransferFailed) as info:
            for layer in range(1, rig.layout.num_layers):
                stream.send_layer(layer, 0, k.clone(), k.clone())
            stream.finish(3)
        assert time.monotonic() - start < 5
        assert info.value.code in (Code.UNAVAILABLE, Code.CANCELLED), info.value
        assert rig.receiver.bulk is not None and rig.receiver.bulk.connections == 0
        assert len(rig.sink.writes) == 1  # nothing landed after the stop
    finally:
        sender.close()
