"""The receiver's side of the bulk TCP transport (kvtransfer.bulk): it issues one-time tickets over the
authenticated OpenBulk call, accepts and authenticates connections that present them, and hands each
authenticated connection to ``serve`` on a thread of its own, which runs its pushes one after another
until the connection closes.

Bounded throughout: tickets plus connections (``max_connections``), hellos in progress
(``max_hellos``; more are refused at once), the time a hello may take (``hello_timeout_s``) and a
ticket's life (``ticket_ttl_s``). A connection whose sender goes away ends its thread (its read sees
the end of the connection) and leaves the count.
"""

from __future__ import annotations

import hmac
import secrets
import socket
import ssl
import threading
import time
from collections.abc import Callable

from kvtransfer.bulk import HELLO, ID_BYTES, OK, SECRET_BYTES, BulkConnection, BulkError, recv_exact, tune
from kvtransfer.wire import pb


class BulkListener:
    """The receiver's side: issues tickets, accepts and authenticates connections, and serves each on a
    thread of its own (``serve(conn)`` returns when the connection is done)."""

    def __init__(self, host: str, serve: Callable[[BulkConnection], None], port: int = 0, *,
                 ticket_ttl_s: float = 30.0, hello_timeout_s: float = 5.0, max_connections: int = 256,
                 max_hellos: int = 32, ssl_context: ssl.SSLContext | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.serve = serve
        self.ssl_context = ssl_context  # TLS server side (mutual), when mTLS is configured
        self.ticket_ttl_s = ticket_ttl_s
        self.hello_timeout_s = hello_timeout_s
        self.max_connections = max_connections
        self.clock = clock
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            tune(self._sock)  # accepted sockets inherit its options
            self._sock.bind((host.strip("[]"), port))
            self._sock.listen(64)
        except OSError:
            self._sock.close()
            raise
        self.host = host
        self.port: int = self._sock.getsockname()[1]
        self._tickets: dict[bytes, tuple[bytes, float]] = {}  # id -> (secret, expiry)
        self._open: dict[bytes, BulkConnection] = {}  # authenticated, being served
        self._lock = threading.Lock()
        self._hellos = threading.BoundedSemaphore(max_hellos)
        self._closed = False
        self._thread = threading.Thread(target=self._accept_loop, name="kv-bulk-accept", daemon=True)
        self._thread.start()

    def issue(self) -> pb.BulkTicket:
        """A ticket for one new connection; BulkError("busy") when the limits are reached."""
        now = self.clock()
        with self._lock:
            self._tickets = {k: v for k, v in self._tickets.items() if v[1] > now}
            if len(self._tickets) + len(self._open) >= self.max_connections:
                raise BulkError(f"this receiver already holds {self.max_connections} bulk connections and "
                                "tickets", "busy")
            conn_id, secret = secrets.token_bytes(ID_BYTES), secrets.token_bytes(SECRET_BYTES)
            self._tickets[conn_id] = (secret, now + self.ticket_ttl_s)
        return pb.BulkTicket(port=self.port, connection_id=conn_id, secret=secret)

    @property
    def connections(self) -> int:
        with self._lock:
            return len(self._open)

    def close(self) -> None:
        """Stop accepting and close every connection (a push in progress on one fails as the sender's
        connection closing would fail it)."""
        with self._lock:
            self._closed = True
            conns, self._open = list(self._open.values()), {}
            self._tickets.clear()
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the accept loop (Linux)
        except OSError:
            pass
        self._thread.join(timeout=2)
        self._sock.close()  # after the loop is gone, so it never accepts on a reused descriptor
        for c in conns:
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
            try:
                threading.Thread(target=self._connection, args=(sock,), name="kv-bulk-conn", daemon=True).start()
            except RuntimeError:  # no thread can start now (a pids limit): refuse this one, keep accepting
                self._hellos.release()
                sock.close()
                time.sleep(0.01)

    def _connection(self, sock: socket.socket) -> None:
        """A connection's thread: its hello, then (authenticated) ``serve`` for the rest of its life."""
        try:
            conn = self._hello(sock)
        finally:
            self._hellos.release()
        if conn is None:
            return
        try:
            self.serve(conn)
        finally:
            with self._lock:
                self._open.pop(conn.id, None)
            conn.close()

    def _hello(self, sock: socket.socket) -> BulkConnection | None:
        """The authenticated connection, its OK sent; None (closed) for anything else."""
        conn_id = b""
        try:
            sock.settimeout(self.hello_timeout_s)  # bounds the TLS handshake too
            if self.ssl_context is not None:
                sock = self.ssl_context.wrap_socket(sock, server_side=True)
            buf = bytearray(len(HELLO) + ID_BYTES + SECRET_BYTES)
            recv_exact(sock, memoryview(buf))
            conn_id = bytes(buf[len(HELLO):len(HELLO) + ID_BYTES])
            secret = bytes(buf[len(HELLO) + ID_BYTES:])
            with self._lock:
                ticket = self._tickets.pop(conn_id, None) if buf[:len(HELLO)] == HELLO else None
                valid = (ticket is not None and ticket[1] > self.clock() and hmac.compare_digest(ticket[0], secret)
                         and not self._closed)
                if valid:
                    conn = BulkConnection(conn_id, sock)
                    self._open[conn_id] = conn  # close() now closes it too
            if not valid:
                sock.close()
                return None
            sock.sendall(OK)
            sock.settimeout(None)  # idle between pushes: blocking
            return conn
        except (BulkError, OSError):  # ssl.SSLError is an OSError: no or a bad certificate
            with self._lock:
                self._open.pop(conn_id, None)
            sock.close()
            return None
