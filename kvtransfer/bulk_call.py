"""The sender's view of one push on a bulk TCP connection: the receiver's ``PushResult``, read off the
connection by a reused thread while the push's chunks are still being written.

Shaped like the ``grpc.Future`` a ``Push`` call returns (``result``, ``cancel``, ``cancelled``,
``exception``, ``add_done_callback``), so ``KVStream`` waits on either the same way. A refusal can
arrive before the finish is written; the stream's done callback then fails it at once, as a failed
gRPC call would.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import grpc
from google.protobuf.message import DecodeError

from kvtransfer.bulk import KIND_RESULT, BulkConnection, BulkError
from kvtransfer.errors import TransferFailed, fresh, status_code
from kvtransfer.reused_threads import ReusedThreads
from kvtransfer.wire import pb

_READERS = ReusedThreads("kv-bulk-result")


class BulkCall:
    def __init__(self, conn: BulkConnection, owner: object, target: str,
                 after: threading.Event | None = None) -> None:
        """``after``: read the result only once it is set (under TLS, when the push's writer is done:
        see ``BulkConnection.tls``); ``cancel`` sets it too."""
        self.conn = conn
        self._after = after
        self.owner = owner  # what the connection is bound to (cancel interrupts only that binding)
        self.target = target
        self._done = threading.Event()
        self._lock = threading.Lock()
        self._ack: pb.PushAck | None = None
        self._error: TransferFailed | None = None
        self._cancelled = False
        self._callbacks: list[Callable[[BulkCall], None]] = []
        _READERS.submit(self._read)

    # ------------------------------------------------------------------ the grpc.Future surface KVStream uses
    def result(self, timeout: float | None = None) -> pb.PushAck:
        if not self._done.wait(timeout):
            raise grpc.FutureTimeoutError()
        if self._cancelled:
            raise grpc.FutureCancelledError()
        if self._error is not None:
            raise fresh(self._error)  # a copy: the kept one, raised, would hold this call in a cycle
        assert self._ack is not None
        return self._ack

    def exception(self) -> TransferFailed | None:
        self._done.wait()
        return self._error

    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> bool:
        """Stop waiting: the connection is closed (the receiver sees the sender gone and releases the
        reservation); False when the result had already arrived."""
        with self._lock:
            if self._done.is_set():
                return False
            self._cancelled = True
            owner = self.owner
        if self._after is not None:
            self._after.set()
        self.conn.interrupt(owner)  # wakes the reader, which completes the call as cancelled
        return True

    def add_done_callback(self, fn: Callable[[BulkCall], None]) -> None:
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn(self)

    # ------------------------------------------------------------------ the reader
    def _read(self) -> None:
        ack, error = None, None
        try:
            if self._after is not None:
                self._after.wait()
                if self._cancelled:
                    raise BulkError("cancelled", "closed")
            _, data = self.conn.read_message((KIND_RESULT,))
            result = pb.PushResult.FromString(data)
            if result.code == 0:
                ack = result.ack
            else:
                error = TransferFailed(f"receiver refused the KV push: {result.message}",
                                       status_code(result.code))
        except BulkError as exc:
            error = (TransferFailed("no result from the receiver within the transfer's deadline",
                                    grpc.StatusCode.DEADLINE_EXCEEDED) if exc.kind == "timeout" else
                     TransferFailed(f"bulk TCP connection to {self.target} failed before the receiver's result: "
                                    f"{exc}", grpc.StatusCode.UNAVAILABLE))
        except DecodeError:
            error = TransferFailed("the receiver sent a malformed PushResult", grpc.StatusCode.INTERNAL)
        except BaseException as exc:  # a bug: the push must fail by name, not wait for its deadline
            error = TransferFailed(f"reading the receiver's result failed: {exc!r}", grpc.StatusCode.INTERNAL)
        with self._lock:
            self._ack, self._error = ack, error
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
            self.owner = None  # the stream holds this call: done, it must not hold the stream (a cycle)
        for fn in callbacks:
            fn(self)
