"""The bulk TCP transport against a real gRPC server and real sockets: tickets and credentials, connection
reuse, and every way a stream on it can break. Each refused push must end with a status naming the
problem, release the reservation, write nothing it should not, close the connection it used, and leave
the receiver serving the next push."""

from __future__ import annotations

import socket
import ssl
import time
from pathlib import Path
from typing import Callable

import grpc
import pytest
import torch

from kv_helpers import AUTH, SECURITY, Frames, OpenPush, Pending, Rig, make_pki, wait_until
from kv_helpers import make_rig, model  # noqa: F401  (fixtures)
from kvtransfer.auth import TransferSecurity
from kvtransfer.bulk import FRAME, HELLO, KIND_CHUNK, KIND_FINISH, OK
from kvtransfer.bulk_listener import BulkListener
from kvtransfer.errors import TransferFailed
from kvtransfer.sender import KVSender
from kvtransfer.wire import OPEN_BULK_METHOD, PUSH_BULK_METHOD, pb

pytestmark = [pytest.mark.integration]

Code = grpc.StatusCode


@pytest.fixture
def rig(make_rig: Callable[..., Rig]) -> Rig:
    rig = make_rig()
    rig.receiver.start_janitor(0.05)
    return rig


def open_bulk(channel: grpc.Channel, metadata=AUTH) -> pb.BulkTicket:  # type: ignore[no-untyped-def]
    call = channel.unary_unary(OPEN_BULK_METHOD, request_serializer=None,
                               response_deserializer=pb.BulkTicket.FromString)
    return call(b"", metadata=tuple(metadata), timeout=5)


def connect(ticket: pb.BulkTicket, secret: bytes | None = None) -> tuple[socket.socket, bytes]:
    """Connect with ``ticket`` (or a wrong ``secret``); returns the socket and the receiver's answer."""
    sock = socket.create_connection(("127.0.0.1", ticket.port), timeout=5)
    sock.sendall(HELLO + ticket.connection_id + (secret if secret is not None else ticket.secret))
    try:
        answer = sock.recv(1)
    except ConnectionResetError:
        answer = b""
    return sock, answer


def send_good_with(rig: Rig, transport: str, pending: Pending | None = None) -> None:
    """A good push from a fresh sender on ``transport``, closed afterwards."""
    sender = KVSender(SECURITY, transport=transport)  # type: ignore[arg-type]
    try:
        rig.send_good(pending or rig.reserve(), sender)
    finally:
        sender.close()


def frame(kind: int, message: bytes) -> bytes:
    return FRAME.pack(kind, len(message)) + message


def bulk_push(rig: Rig, rid: str, *, timeout: float = 10.0) -> tuple[OpenPush, socket.socket, Frames]:
    """A raw push on the tcp transport: its handshake sent over gRPC; the caller writes the socket."""
    ticket = open_bulk(rig.channel)
    sock, answer = connect(ticket)
    assert answer == OK
    frames = Frames(rig.layout, rid)
    push = OpenPush(rig.channel, AUTH, timeout=timeout)
    push.send(frames.handshake(transport=pb.TRANSPORT_TCP, bulk_id=ticket.connection_id))
    return push, sock, frames


# ---------------------------------------------------------------------- good pushes
def test_pushes_over_tcp_land_exactly_and_reuse_one_connection(rig: Rig) -> None:
    sender = KVSender(SECURITY, transport="tcp", bulk_chunk_bytes=300)  # several chunks per layer
    try:
        for _ in range(3):
            result = rig.send_good(rig.reserve(), sender)  # checks every landed value
            assert result.transport == "tcp" and result.num_chunks > rig.layout.num_layers
        assert rig.receiver.bulk is not None and rig.receiver.bulk.connections == 1
    finally:
        sender.close()
    wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the closed sender's connection to be pruned")
    rig.assert_clean()


def test_a_hand_written_push_over_the_bulk_connection_is_acknowledged(rig: Rig) -> None:
    pending = rig.reserve("by-hand")
    push, sock, frames = bulk_push(rig, "by-hand")
    with sock:
        sock.sendall(b"".join(frame(KIND_CHUNK, c) for c in frames.all_layers()))
        sock.sendall(frame(KIND_FINISH, frames.finish(first_token=11)))
        ack = push.result()
    assert (ack.num_chunks, ack.num_bytes, ack.checksum) == (frames.seq, frames.nbytes, frames.checksum.value)
    outcome = pending.outcome()
    assert outcome.ok and outcome.first_token == 11
    assert rig.engine.release(pending.reservation)
    rig.assert_clean()


# ---------------------------------------------------------------------- credentials and tickets
def test_open_bulk_needs_the_token(rig: Rig) -> None:
    for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),)):
        with pytest.raises(grpc.RpcError) as err:
            open_bulk(rig.channel, metadata)
        assert err.value.code() == Code.UNAUTHENTICATED
    assert rig.receiver.bulk is not None and rig.receiver.bulk.connections == 0


def push_bulk(channel: grpc.Channel, request: bytes, metadata=AUTH, timeout: float = 10.0) -> pb.PushAck:  # type: ignore[no-untyped-def]
    call = channel.unary_unary(PUSH_BULK_METHOD, request_serializer=None, response_deserializer=pb.PushAck.FromString)
    return call(request, metadata=tuple(metadata), timeout=timeout)


def test_push_bulk_needs_the_token_and_a_tcp_handshake(rig: Rig) -> None:
    """PushBulk (the unary call that opens a tcp-transport push) is refused without the token, for a
    handshake of another transport, and for bytes that are no handshake; the reservation is released
    where one was named, and the receiver then serves a good push."""
    frames = Frames(rig.layout, "pb-unauth")
    for metadata in ((), (("authorization", "Bearer wrong-token-0123456789"),)):
        with pytest.raises(grpc.RpcError) as err:
            push_bulk(rig.channel, frames.handshake(transport=pb.TRANSPORT_TCP), metadata)
        assert err.value.code() == Code.UNAUTHENTICATED
    pending = rig.reserve("pb-grpc-transport")
    with pytest.raises(grpc.RpcError) as err:
        push_bulk(rig.channel, Frames(rig.layout, pending.rid).handshake())  # TRANSPORT_GRPC
    assert err.value.code() == Code.INVALID_ARGUMENT and "only TRANSPORT_TCP" in (err.value.details() or "")
    rig.assert_failed(pending, Code.INVALID_ARGUMENT, "only TRANSPORT_TCP")
    for junk in (b"", b"\xff\xff\xff", Frames(rig.layout, "x").finish()):
        with pytest.raises(grpc.RpcError) as err:
            push_bulk(rig.channel, junk)
        assert err.value.code() == Code.INVALID_ARGUMENT
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
    listener = BulkListener("127.0.0.1", hello_timeout_s=0.3)
    try:
        sock = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        start = time.monotonic()
        assert sock.recv(1) == b""  # the receiver hung up
        assert time.monotonic() - start < 3
        sock.close()
        assert listener.connections == 0
    finally:
        listener.close()


def test_a_connection_named_right_after_its_ok_is_waited_for(monkeypatch: pytest.MonkeyPatch) -> None:
    """The sender names a new connection in its handshake as soon as it reads the OK; the receiver may
    not have filed it yet. The claim waits for it (it once failed as "no such bulk connection")."""
    file = BulkListener._file

    def slow_filing(self: BulkListener, conn_id: bytes, sock: socket.socket) -> None:
        time.sleep(0.3)  # the OK is out; the connection is not yet idle
        file(self, conn_id, sock)

    monkeypatch.setattr(BulkListener, "_file", slow_filing)
    listener = BulkListener("127.0.0.1")
    try:
        ticket = listener.issue()
        sock, answer = connect(ticket)
        assert answer == OK
        conn = listener.claim(ticket.connection_id, timeout_s=5)  # before the filing is done
        assert conn.id == ticket.connection_id and listener.connections == 1
        listener.release(conn, reusable=False)
        sock.close()
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
    finally:
        sender.close()
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
def test_a_handshake_naming_an_unknown_connection_is_refused(rig: Rig) -> None:
    pending = rig.reserve()
    frames = Frames(rig.layout, pending.rid)
    push = OpenPush(rig.channel, AUTH)
    push.send(frames.handshake(transport=pb.TRANSPORT_TCP, bulk_id=bytes(16)))
    err = push.error()
    assert err.code() == Code.FAILED_PRECONDITION and "no such bulk connection" in err.details()
    push.end()
    # the stream never claimed the reservation, so it still waits; a good push completes it
    send_good_with(rig, "tcp", pending)
    rig.assert_clean()


@pytest.mark.parametrize("case", ["corrupted", "out of order", "oversized", "unknown kind", "truncated",
                                  "kind mismatch"])
def test_bad_bulk_frames_are_refused_and_the_connection_closed(rig: Rig, case: str) -> None:
    pending = rig.reserve()
    push, sock, frames = bulk_push(rig, pending.rid)
    expect = {"corrupted": (Code.DATA_LOSS, "checksum mismatch"), "out of order": (Code.INVALID_ARGUMENT, "out of order"),
              "oversized": (Code.INVALID_ARGUMENT, "bulk frame of"), "unknown kind": (Code.INVALID_ARGUMENT, "kind 9"),
              "truncated": (Code.DATA_LOSS, "ended before the finish"),
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
        elif case == "truncated":
            data = frame(KIND_CHUNK, frames.chunk(0))
            sock.sendall(data[:len(data) // 2])
            sock.shutdown(socket.SHUT_WR)  # the sender goes away mid-frame
        else:
            sock.sendall(frame(KIND_FINISH, frames.chunk(0)))
        err = push.error()
        assert err.code() == expect[0] and expect[1] in err.details(), err.details()
        sock.settimeout(5)
        try:
            assert sock.recv(1) == b""  # the receiver closed the connection: nothing of it is reused
        except ConnectionResetError:
            pass
    push.end()
    rig.assert_failed(pending, expect[0], expect[1])
    assert rig.sink.writes == []
    wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the connection to be closed")
    rig.assert_clean()
    rig.good_transfer()
    send_good_with(rig, "tcp")
    rig.assert_clean()


def test_a_stalled_sender_hits_the_deadline_and_frees_the_reservation(rig: Rig) -> None:
    pending = rig.reserve()
    push, sock, frames = bulk_push(rig, pending.rid, timeout=1.0)
    with sock:
        sock.sendall(frame(KIND_CHUNK, frames.chunk(0)))  # one layer, then silence
        start = time.monotonic()
        err = push.error(timeout=5)
        assert err.code() == Code.DEADLINE_EXCEEDED
        wait_until(pending.done.is_set, 3, "the reservation to be released")
        assert time.monotonic() - start < 3
    push.end()
    outcome = pending.outcome()
    assert not outcome.ok and outcome.code in (Code.CANCELLED, Code.DEADLINE_EXCEEDED), outcome
    assert rig.engine.release(pending.reservation) is False
    wait_until(lambda: rig.receiver.bulk.connections == 0, 5, "the connection to be closed")
    rig.good_transfer()
    rig.assert_clean()


def test_a_sender_cancel_mid_stream_frees_both_sides(rig: Rig) -> None:
    pending = rig.reserve()
    sender = KVSender(SECURITY, transport="tcp")
    try:
        n = rig.layout.blocks_for(pending.reservation.num_tokens)
        stream = sender.open_stream(rig.target, pending.rid, rig.layout, pending.reservation.num_tokens, timeout_s=10)
        k = torch.randn(rig.layout.block_shape(n))
        stream.send_layer(0, 0, k, k.clone())
        rig.sink.wait_for(1)
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

