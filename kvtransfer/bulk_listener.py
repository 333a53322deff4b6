"""The receiver's side of the bulk TCP transport (kvtransfer.bulk): it issues one-time tickets over the
authenticated OpenBulk call, accepts and authenticates connections that present them, and lends each
connection to one stream at a time.

Bounded throughout: tickets plus connections (``max_connections``), hellos in progress
(``max_hellos``; more are refused at once), the time a hello may take (``hello_timeout_s``) and a
ticket's life (``ticket_ttl_s``). Idle connections whose sender went away are closed by ``prune``.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import ssl
import threading
import time
from typing import Callable

from kvtransfer.bulk import HELLO, ID_BYTES, OK, SECRET_BYTES, BulkConnection, BulkError, peer_closed, recv_exact, tune
from kvtransfer.wire import pb


class BulkListener:
    """The receiver's side: issues tickets, accepts and authenticates connections, and lends each to
    one stream at a time."""

    def __init__(self, host: str, port: int = 0, *, ticket_ttl_s: float = 30.0, hello_timeout_s: float = 5.0,
                 max_connections: int = 256, max_hellos: int = 32, ssl_context: ssl.SSLContext | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ssl_context = ssl_context  # TLS server side (mutual), when mTLS is configured
        self.ticket_ttl_s = ticket_ttl_s
        self.hello_timeout_s = hello_timeout_s
        self.max_connections = max_connections
        self.clock = clock
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(self._sock)  # before listen: accepted sockets inherit it, and the window scale follows it
            self._sock.bind((host.strip("[]"), port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._tickets: dict[bytes, tuple[bytes, float]] = {}  # id -> (secret, expiry)
        self._idle: dict[bytes, BulkConnection] = {}
        self._busy: set[bytes] = set()
        self._arriving: set[bytes] = set()  # ticket checked, OK being sent: claim() waits for these
        self._cv = threading.Condition()
        self._hellos = threading.BoundedSemaphore(max_hellos)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kv-bulk-accept", daemon=True)
        self._thread.start()

    def issue(self) -> "pb.BulkTicket":
        """A ticket for one new connection; BulkError("busy") when the limits are reached."""
        now = self.clock()
        with self._cv:
            self._tickets = {k: v for k, v in self._tickets.items() if v[1] > now}
            if len(self._tickets) + len(self._arriving) + len(self._idle) + len(self._busy) >= self.max_connections:
                raise BulkError(f"this receiver already holds {self.max_connections} bulk connections and "
                                "tickets", "busy")
            conn_id, secret = secrets.token_bytes(ID_BYTES), secrets.token_bytes(SECRET_BYTES)
            self._tickets[conn_id] = (secret, now + self.ticket_ttl_s)
        return pb.BulkTicket(port=self.port, connection_id=conn_id, secret=secret)

    def claim(self, conn_id: bytes, timeout_s: float) -> BulkConnection:
        """Lend connection ``conn_id`` to one stream, waiting up to ``timeout_s`` for its hello."""
        end = time.monotonic() + timeout_s
        with self._cv:
            while conn_id not in self._idle:
                if conn_id in self._busy:
                    raise BulkError("that bulk connection already carries another stream", "refused")
                if conn_id not in self._tickets and conn_id not in self._arriving:
                    raise BulkError("no such bulk connection (never opened, closed, or its ticket expired)",
                                    "refused")
                remaining = end - time.monotonic()
                if remaining <= 0:
                    raise BulkError("the bulk connection did not arrive in time", "timeout")
                self._cv.wait(remaining)
            conn = self._idle.pop(conn_id)
            self._busy.add(conn_id)
        return conn

    def release(self, conn: BulkConnection, reusable: bool) -> None:
        """Take a connection back after its stream: filed for the next one, or closed."""
        conn.unbind()
        with self._cv:
            self._busy.discard(conn.id)
            if reusable and not self._closed:
                self._idle[conn.id] = conn
                return
        conn.close()

    def prune(self) -> None:
        """Close idle connections whose sender has gone (the janitor calls this)."""
        with self._cv:
            gone = [c for c in self._idle.values() if peer_closed(c.sock)]
            for c in gone:
                del self._idle[c.id]
        for c in gone:
            c.close()

    @property
    def connections(self) -> int:
        with self._cv:
            return len(self._idle) + len(self._busy)

    def close(self) -> None:
        with self._cv:
            self._closed = True
            idle, self._idle = list(self._idle.values()), {}
            self._tickets.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (Linux)
        except OSError:
            pass
        self._thread.join(timeout=2)
        self._sock.close()  # after the loop is gone, so it never accepts on a reused descriptor
        for c in idle:
            c.close()

    # ------------------------------------------------------------------ accepting
    def _accept_loop(self) -> None:
        while not self._closed:
            try:
                sock, _ = self._sock.accept()
            except OSError:
                if self._closed:
                    return
                time.sleep(0.01)  # e.g. out of file descriptors: do not spin
                continue
            if not self._hellos.acquire(blocking=False):  # too many half-open connections: refuse this one
                sock.close()
                continue
            threading.Thread(target=self._hello, args=(sock,), name="kv-bulk-hello", daemon=True).start()

    def _file(self, conn_id: bytes, sock: socket.socket) -> None:
        """An authenticated connection, its OK sent: idle, ready for the stream that names it."""
        with self._cv:
            self._arriving.discard(conn_id)
            if self._closed:
                sock.close()
            else:
                self._idle[conn_id] = BulkConnection(conn_id, sock)
            self._cv.notify_all()

    def _hello(self, sock: socket.socket) -> None:
        arriving: bytes | None = None
        try:
            sock.settimeout(self.hello_timeout_s)  # bounds the TLS handshake too
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_side=True)
            buf = bytearray(len(HELLO) + ID_BYTES + SECRET_BYTES)
            recv_exact(sock, memoryview(buf))
            conn_id = bytes(buf[len(HELLO):len(HELLO) + ID_BYTES])
            secret = bytes(buf[len(HELLO) + ID_BYTES:])
            with self._cv:
                ticket = self._tickets.pop(conn_id, None) if buf[:len(HELLO)] == HELLO else None
                valid = (ticket is not None and ticket[1] > self.clock() and hmac.compare_digest(ticket[0], secret)
                         and not self._closed)
                if valid:
                    # The sender may name this connection in a handshake as soon as it reads our OK,
                    # before it is filed below: claim() waits for it meanwhile, as for a ticket.
                    arriving = conn_id
                    self._arriving.add(conn_id)
            if not valid:
                sock.close()
                return
            sock.sendall(OK)
            sock.settimeout(None)
            arriving = None
            self._file(conn_id, sock)
        except (BulkError, OSError):  # ssl.SSLError is an OSError: no or a bad certificate
            sock.close()
        finally:
            if arriving is not None:  # the OK could not be sent: a claim waiting for it fails now
                with self._cv:
                    self._arriving.discard(arriving)
                    self._cv.notify_all()
            self._hellos.release()
