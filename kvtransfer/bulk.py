"""The bulk TCP transport: a push travels whole over a plain TCP connection, no gRPC call per push. A
shared-memory push uses the same connection for its control messages (its bytes stay in the segment).

Why: grpcio's Python stream moves a fraction of what a TCP socket does (its receiving side copies each
message three times), so no codec can bring a gRPC push to the socket's rate; and a gRPC call per push
(opening it, delivering its request to a handler thread, returning its answer) costs a small push more
than its data does. docs/performance.md (KV transfer) has the current figures and the command behind them.

Each message is a 5-byte header (kind, then a little-endian uint32 length) and the message's bytes:
the sender's handshake, chunks and finish (``PushMessage`` bytes, byte for byte what ``Push`` would
carry; the handshake holds the push's deadline), then the receiver's ``PushResult`` (status, message,
ack). See proto/epd/kvtransfer/v1/kvtransfer.proto for the contract.

This module holds the framing, the connection both sides use and the sender's ``BulkConnector``; the
receiver's ``BulkListener`` is in kvtransfer.bulk_listener, and what it does with each push in
kvtransfer.receiver (``KVReceiver.serve_bulk``).

Opening a connection (once per sender and receiver, then reused by one push at a time):
  1. the sender calls ``OpenBulk`` over its authenticated gRPC channel (token or mTLS, checked by
     the interceptor like every other call); the receiver answers a port, a connection id and a
     one-time secret that expires after ``ticket_ttl_s``;
  2. the sender connects to that port on the receiver's host and sends HELLO, the id, the secret;
  3. the receiver compares the secret in constant time, answers OK, and a thread of its own serves
     the connection from then on: a push, its result, the next push.
The connection is then the credential of every push on it. After a refused push the receiver reads
and drops what the sender still sends until the sender closes; after any failure neither side reuses
the connection, so it never carries a push's leftovers into the next one. A connection that presents
no valid ticket within ``hello_timeout_s`` is closed; connections, tickets and hellos in progress are
all bounded.

With mTLS configured, the connection runs TLS with the same CA, certificate and key as the gRPC
channel (mutual: the receiver requires the sender's certificate); the ticket is then checked inside
it. With a token only, the bytes are as private as the gRPC stream without TLS.
"""

from __future__ import annotations

import queue
import socket
import ssl
import struct
import threading
import time
from collections.abc import Callable, Iterator, Sequence

import numpy as np

from kvtransfer.errors import detached
from kvtransfer.reused_threads import ReusedThreads
from kvtransfer.wire import pb

HELLO = b"EPDKV\x02"  # 2: the whole push on the connection (1 carried its handshake and ack on gRPC)
OK = b"\x01"
ID_BYTES, SECRET_BYTES = 16, 32
FRAME = struct.Struct("<BI")  # kind, length of the message that follows
KIND_HANDSHAKE, KIND_CHUNK, KIND_FINISH = 1, 2, 3  # sender -> receiver: PushMessage bytes (its oneof's numbers)
KIND_RESULT = 4  # receiver -> sender: a PushResult
KIND_LEASE, KIND_LEASE_RESULT = 5, 6  # a CudaIpcLeaseRequest, and its CudaIpcLeaseResult (before a cuda_ipc push)
CONTROL_BYTES = 64 * 2**10  # the most a handshake or a result may take
# TCP keepalive: an idle connection whose peer host vanished (no FIN, no reset) is found dead after
# ~60 s instead of holding the receiver's thread for it, and its place under max_connections, for good.
KEEPALIVE_IDLE_S, KEEPALIVE_INTERVAL_S, KEEPALIVE_PROBES = 30, 10, 3
Buffer = bytes | bytearray | memoryview


class BulkError(Exception):
    """A bulk connection could not be opened, claimed, read or written; ``kind`` says how it failed."""

    def __init__(self, message: str, kind: str = "io") -> None:
        super().__init__(message)
        self.kind = kind  # "io" | "closed" | "timeout" | "protocol" | "refused" | "busy"


def tune(sock: socket.socket) -> None:
    """TCP_NODELAY and keepalive. The buffers are left to the kernel's autotuning (up to net.ipv4.tcp_rmem's
    maximum to receive): setting SO_SNDBUF/SO_RCVBUF turns autotuning off for the socket, which made large
    pushes slower on loopback, and across hosts autotuning grows the window to the path's bandwidth-delay
    product."""
    if sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
        if hasattr(socket, "TCP_KEEPIDLE"):  # Linux; elsewhere the system's keepalive timing applies
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPIDLE, KEEPALIVE_IDLE_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPINTVL, KEEPALIVE_INTERVAL_S)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_KEEPCNT, KEEPALIVE_PROBES)


def recv_exact(sock: socket.socket, view: memoryview, deadline: float | None = None) -> None:
    """Fill ``view`` from ``sock``; BulkError on EOF, timeout or a socket error. With ``deadline`` (a
    ``time.monotonic()`` value) each read waits at most until then, so a trickling peer cannot stretch
    it (``sock`` must then be in timeout mode: ``bind`` with a timeout)."""
    got, n = 0, view.nbytes
    try:
        while got < n:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                sock.settimeout(left)
            k = sock.recv_into(view[got:], n - got)
            if k == 0:
                raise BulkError(f"the connection closed after {got} of {n} bytes", "closed")
            got += k
    except TimeoutError:
        raise BulkError("timed out reading the bulk connection", "timeout") from None
    except OSError as exc:
        raise BulkError(f"bulk connection error: {exc.strerror or exc}", "closed") from None


def send_all(sock: socket.socket, parts: Sequence[Buffer]) -> None:
    """Write every part, in order, with as few system calls as the kernel allows (no joining copy)."""
    views = [memoryview(p).cast("B") for p in parts if len(p)]
    try:
        if isinstance(sock, ssl.SSLSocket):  # no sendmsg over TLS; it copies into its records anyway
            for v in views:
                sock.sendall(v)
            return
        while views:
            sent = sock.sendmsg(views[:512])  # IOV_MAX is 1024 on Linux
            while sent:
                if sent >= views[0].nbytes:
                    sent -= views[0].nbytes
                    views.pop(0)
                else:
                    views[0] = views[0][sent:]
                    sent = 0
    except TimeoutError:
        raise BulkError("timed out writing to the bulk connection (receiver not reading?)", "timeout") from None
    except OSError as exc:
        raise BulkError(f"bulk connection error: {exc.strerror or exc}", "closed") from None


def hard_close(sock: socket.socket) -> None:
    """Close now, waking any thread blocked in a send or receive on it."""
    try:
        sock.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass
    sock.close()


def peer_closed(sock: socket.socket, data_means_closed: bool = False) -> bool:
    """True when an idle connection's other end is gone (EOF or error pending). On the receiver, data
    waiting to be read does not count: a stream's first chunk can arrive before its handler claims the
    connection. On the sender (``data_means_closed``) it does: a receiver never writes after its OK, so
    anything there (a TLS close alert) means the connection is done. Peeks at the raw bytes, under TLS
    too. ``sock`` must be in blocking mode (no timeout), or Python waits for it to become readable first."""
    try:
        got = socket.socket.recv(sock, 1, socket.MSG_PEEK | socket.MSG_DONTWAIT)  # the raw socket's, not TLS's
    except (BlockingIOError, InterruptedError):
        return False
    except OSError:
        return True
    return got == b"" or data_means_closed


_READERS = ReusedThreads("kv-bulk-read")  # each stream's frame reader (see read_frames)


class BulkConnection:
    """One authenticated connection and its receive buffer (reused across its streams)."""

    def __init__(self, conn_id: bytes, sock: socket.socket) -> None:
        self.id = conn_id
        self.sock = sock
        # Under TLS one thread at a time may use the connection: an SSL object read by one thread while
        # another writes it fails now and then (seen here as a connection closed mid-push under mTLS,
        # about one run in ten of the mTLS test). So under TLS frames are read on the caller's thread,
        # and a sender reads its result only once its writer is done (KVStream).
        self.tls = isinstance(sock, ssl.SSLSocket)
        self._lock = threading.Lock()
        self._owner: object | None = None  # the stream using it now

    # ------------------------------------------------------------------ receiving side
    def read_message(self, kinds: tuple[int, ...], max_bytes: int = CONTROL_BYTES,
                     deadline: float | None = None) -> tuple[int, bytes]:
        """One small message (a handshake, a result), read whole into a new buffer."""
        kind, n = self._read_header(kinds, max_bytes, deadline)
        buf = bytearray(n)
        recv_exact(self.sock, memoryview(buf), deadline)
        return kind, bytes(buf)

    def read_frames(self, max_bytes: int, deadline: float | None = None,
                    ahead: bool = True) -> Iterator[tuple[int, memoryview]]:
        """A push's chunk frames, up to and including its finish. Double-buffered (``ahead``): a helper
        thread reads the next frame off the socket while the caller works on this one, whose view stays
        valid until the caller asks for the next. The two buffers grow to the push's largest frame and
        are dropped with it: an idle connection holds no memory. (numpy.empty: not zero-filled, and
        with kvtransfer.memory's malloc settings the next push reuses the same pages.) Under TLS, or
        without ``ahead`` (small control frames, where the hand-off would cost more than the read),
        one buffer, read on the caller's thread (see ``tls``)."""
        bufs = [np.empty(0, dtype=np.uint8), np.empty(0, dtype=np.uint8)]
        if self.tls or not ahead:
            while True:
                kind, view = self._read_frame(bufs, 0, max_bytes, deadline)
                yield kind, view
                if kind == KIND_FINISH:
                    return
        ready: queue.Queue = queue.Queue()  # unbounded, so the reader never blocks on it: the two buffers bound it
        free: queue.Queue = queue.Queue()
        for i in range(2):
            free.put(i)

        def reader() -> None:
            try:
                while True:
                    slot = free.get()
                    if slot is None:
                        return
                    kind, view = self._read_frame(bufs, slot, max_bytes, deadline)
                    ready.put((kind, view, slot))
                    if kind == KIND_FINISH:
                        return
            except BulkError as exc:  # detached: this frame holds ``ready``, which may keep it
                ready.put(detached(exc))
            except BaseException as exc:  # a bug: the push must fail, not wait for a frame forever
                ready.put(BulkError(f"bulk reader failed: {exc!r}", "io"))

        _READERS.submit(reader)
        try:
            while True:
                item = ready.get()
                if isinstance(item, BulkError):
                    try:
                        raise item
                    finally:  # this frame goes into the error's traceback: it must not hold the error too
                        del item
                kind, view, slot = item
                yield kind, view
                if kind == KIND_FINISH:
                    return
                free.put(slot)
        finally:
            free.put(None)  # a reader waiting for a buffer stops; one blocked in recv stops when the socket closes

    def _read_header(self, kinds: tuple[int, ...], max_bytes: int, deadline: float | None) -> tuple[int, int]:
        head = bytearray(FRAME.size)
        recv_exact(self.sock, memoryview(head), deadline)
        kind, n = FRAME.unpack(head)
        if kind not in kinds:
            raise BulkError(f"unexpected bulk message kind {kind} (expected {' or '.join(map(str, kinds))})",
                            "protocol")
        if n == 0 or n > max_bytes:
            raise BulkError(f"bulk message of {n} bytes (this side takes 1..{max_bytes})", "protocol")
        return kind, n

    def _read_frame(self, bufs: list, slot: int, max_bytes: int, deadline: float | None) -> tuple[int, memoryview]:
        kind, n = self._read_header((KIND_CHUNK, KIND_FINISH), max_bytes, deadline)
        if bufs[slot].nbytes < n:
            bufs[slot] = np.empty(n, dtype=np.uint8)
        view = memoryview(bufs[slot])[:n]
        recv_exact(self.sock, view, deadline)
        return kind, view

    def drain(self, timeout_s: float) -> None:
        """After a refusal: read and drop what the peer still sends until it closes (or ``timeout_s``),
        so the result written before is read by the peer instead of lost to a reset."""
        deadline = time.monotonic() + timeout_s
        scratch = bytearray(256 * 2**10)
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            return
        try:
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                self.sock.settimeout(left)
                if self.sock.recv_into(scratch) == 0:
                    return
        except OSError:  # timeout, reset, TLS alert: done either way
            return

    def bind(self, owner: object, timeout_s: float | None) -> None:
        with self._lock:
            self._owner = owner
            self.sock.settimeout(timeout_s)

    def unbind(self) -> None:
        with self._lock:
            self._owner = None
            if self.sock.fileno() >= 0:
                self.sock.settimeout(None)  # idle: blocking, so peer_closed's MSG_DONTWAIT peek never waits

    def release(self, owner: object) -> None:
        """``owner`` lets go of the connection (if it still holds it): its ``interrupt`` no longer applies."""
        with self._lock:
            if self._owner is owner:
                self._owner = None

    def interrupt(self, owner: object) -> None:
        """Wake ``owner``'s blocked read or write by closing the connection, unless it moved on."""
        with self._lock:
            if self._owner is owner:
                self._owner = None  # closed: it serves no one now (and keeps no stream alive in a cycle)
                hard_close(self.sock)

    # ------------------------------------------------------------------ sending side
    def send_frame(self, kind: int, parts: Sequence[Buffer]) -> None:
        n = sum(memoryview(p).nbytes for p in parts)
        send_all(self.sock, [FRAME.pack(kind, n), *parts])

    def close(self) -> None:
        with self._lock:
            self._owner = None  # as in interrupt
        hard_close(self.sock)


class BulkConnector:
    """The sender's side: opens connections with tickets and keeps idle ones per target."""

    def __init__(self, max_idle_per_target: int = 8, ssl_context: ssl.SSLContext | None = None,
                 server_name: str | None = None) -> None:
        self.max_idle_per_target = max_idle_per_target
        self.ssl_context = ssl_context  # TLS client side, when mTLS is configured
        self.server_name = server_name  # the name to expect in the receiver's certificate (default: its host)
        self._idle: dict[str, list[BulkConnection]] = {}
        self._lock = threading.Lock()

    def take(self, target: str, open_ticket: Callable[[float], pb.BulkTicket], timeout_s: float) -> BulkConnection:
        """An idle connection to ``target``, or a new one (``open_ticket`` calls OpenBulk over gRPC)."""
        while True:
            with self._lock:
                idle = self._idle.get(target)
                conn = idle.pop() if idle else None
            if conn is None:
                break
            if not peer_closed(conn.sock, data_means_closed=True):
                return conn
            conn.close()
        host = target_host(target)
        ticket = open_ticket(timeout_s)
        if len(ticket.connection_id) != ID_BYTES or len(ticket.secret) != SECRET_BYTES or not 0 < ticket.port < 65536:
            raise BulkError("the receiver sent a malformed bulk ticket", "protocol")
        try:
            sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
            tune(sock)
            sock.settimeout(timeout_s)
            sock.connect((host, ticket.port))
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_hostname=self.server_name or host)
        except ssl.SSLError as exc:
            sock.close()
            raise BulkError(f"TLS with the receiver's bulk port {host}:{ticket.port} failed: {exc.reason or exc}",
                            "refused") from None
        except TimeoutError:
            sock.close()
            raise BulkError(f"timed out connecting to the receiver's bulk port {host}:{ticket.port}",
                            "timeout") from None
        except OSError as exc:
            sock.close()
            raise BulkError(f"cannot connect to the receiver's bulk port {host}:{ticket.port}: "
                            f"{exc.strerror or exc}", "io") from None
        try:
            send_all(sock, [HELLO, ticket.connection_id, ticket.secret])
            answer = bytearray(1)
            recv_exact(sock, memoryview(answer))
        except BulkError as exc:
            sock.close()
            raise BulkError(f"the receiver did not accept the bulk connection: {exc}", exc.kind) from None
        if bytes(answer) != OK:
            sock.close()
            raise BulkError("the receiver refused the bulk connection", "refused")
        sock.settimeout(None)
        return BulkConnection(ticket.connection_id, sock)

    def idle(self, target: str) -> int:
        """Connections to ``target`` waiting for the next push."""
        with self._lock:
            return len(self._idle.get(target, ()))

    def give(self, target: str, conn: BulkConnection) -> None:
        """Return a connection whose stream the receiver acknowledged."""
        conn.unbind()
        with self._lock:
            idle = self._idle.setdefault(target, [])
            if len(idle) < self.max_idle_per_target:
                idle.append(conn)
                return
        conn.close()

    def close(self) -> None:
        with self._lock:
            idle, self._idle = [c for cs in self._idle.values() for c in cs], {}
        for c in idle:
            c.close()


def target_host(target: str) -> str:
    """The host part of a ``host:port`` gRPC target (``[v6]:port`` too); BulkError for others."""
    if target.startswith(("unix:", "unix-abstract:")) or ":" not in target:
        raise BulkError(f"the tcp transport needs a host:port target, not {target!r}", "protocol")
    host = target.rsplit(":", 1)[0]
    for prefix in ("ipv4:", "ipv6:", "dns:///", "dns:"):
        if host.startswith(prefix):
            host = host[len(prefix):]
    return host.strip("[]")
