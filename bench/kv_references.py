"""Reference ceilings that the KV-transfer benchmark prints beside its own figures.

    python -m bench.kv_references [--bytes 268435456] [--repeats 3] [--chunk 4194304]

Each function moves ``nbytes`` once per repeat over one path and returns the best (shortest) repeat
as a :class:`Measurement`:

* :func:`memcpy`: ``dst.copy_(src)`` between two preallocated uint8 torch tensors (one warm-up copy
  first, so page faults are excluded).
* :func:`tcp_socket` / :func:`unix_socket`: ``sendall`` of memoryview slices of one preallocated
  bytearray to a receiver process that ``recv_into``s a preallocated bytearray and answers with a
  1-byte ack; timed from the first send to the ack.
* :func:`grpc_raw_stream`: a client stream of pre-made ``bytes`` chunks to a generic-handler gRPC
  server that takes them as raw bytes and answers with an 8-byte count; timed from the call to its
  response.
* :func:`grpc_proto_bytes_stream`: the same with every chunk inside a protobuf ``BytesValue``
  (serialized and parsed by the real protobuf runtime within the timed window).

Every receiver runs in its own process (multiprocessing "spawn"), started once per function call.
After each repeat, outside the timed window, the receiver compares the byte count and CRC-32 of what
it got against what was sent and the call raises :class:`TransferCheckError` on any difference, so
:attr:`Measurement.nbytes` is a byte count the receiver has confirmed. The receivers import only the
standard library (plus grpc/protobuf for the gRPC ones); torch is imported lazily by :func:`memcpy`
only, numpy lazily by the sending side only.

Absolute figures drift between runs and machines; compare ratios to :func:`memcpy` from the same run.
A script that calls these functions needs the ``if __name__ == "__main__":`` guard: the receivers are
spawned, and a spawned child imports the parent's main module.
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import shutil
import socket
import statistics
import struct
import sys
import tempfile
import time
import traceback
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NoReturn

from kvtransfer.options import MAX_MESSAGE_BYTES, bulk_channel_options

MiB = 1 << 20
DEFAULT_CHUNK = 4 * MiB

FAST_CHANNEL_OPTIONS: tuple[tuple[str, int], ...] = bulk_channel_options(64 * MiB)
"""Options for bulk client streams; pass the same tuple to ``grpc.server`` and to the channel.

Chosen by interleaved A/B runs (2 cores shared with other work, 256 MiB in 4 MiB chunks, 12-30 calls
per option set and run, both orders): the raw-bytes stream's median was 10-75% above
:data:`BASE_CHANNEL_OPTIONS` in all six runs; the protobuf ``bytes`` stream was the same within noise
(+-20%, either way; protobuf's copies bound it, not flow control). The window pair alone and the read
sizes alone each helped the raw stream less consistently than both together. Not kept:
``grpc.http2.max_frame_size`` 16 MiB, ``grpc.http2.write_buffer_size`` 16 MiB and
``grpc.optimization_target=throughput`` (no gain or slower), ``lookahead_bytes`` with BDP probing on
(the same as the defaults).
"""

_SERVICE = "epd.bench.Sink"
_METHOD = "Stream"
_FULL_METHOD = f"/{_SERVICE}/{_METHOD}"
_START_TIMEOUT_S = 60.0  # a spawned child importing grpc on a busy 2-core machine
_IO_TIMEOUT_S = 120.0
_JOIN_TIMEOUT_S = 10.0
_ACK = b"\x01"
_COUNT = struct.Struct("<Q")


class TransferCheckError(RuntimeError):
    """A receiver got other bytes than were sent, or failed, or went silent."""


@dataclass(frozen=True)
class Measurement:
    """``nbytes`` moved (and confirmed by the receiver) in ``seconds``, best of the repeats."""

    name: str
    nbytes: int
    seconds: float

    @property
    def gbps(self) -> float:
        """Decimal gigabytes per second."""
        return self.nbytes / self.seconds / 1e9


# ----------------------------------------------------------------------------------------- memcpy


def memcpy(nbytes: int, repeats: int = 3, threads: int | None = None) -> Measurement:
    """``dst.copy_(src)`` between two preallocated uint8 tensors; ``threads`` sets torch's intra-op
    thread count for the call (default: torch's current setting). The name reports the count used."""
    _check_args(nbytes, 1, repeats)
    if threads is not None and threads < 1:
        raise ValueError(f"threads must be >= 1, got {threads}")
    import torch  # lazily: nothing else here needs it, and the receivers must not import it

    previous = torch.get_num_threads()
    used = previous if threads is None else threads
    src = torch.empty(nbytes, dtype=torch.uint8)
    src.fill_(0xA5)  # touch every page (an untouched source would read the shared zero page)
    dst = torch.empty_like(src)
    best = float("inf")
    torch.set_num_threads(used)
    try:
        dst.copy_(src)  # warm-up: faults in dst's pages
        for _ in range(repeats):
            t0 = time.perf_counter()
            dst.copy_(src)
            best = min(best, time.perf_counter() - t0)
    finally:
        torch.set_num_threads(previous)
    if not torch.equal(dst, src):
        raise TransferCheckError("memcpy: destination differs from source")
    return Measurement(f"memcpy ({used} thread{'' if used == 1 else 's'})", nbytes, best)


# ---------------------------------------------------------------------------------------- sockets


def tcp_socket(nbytes: int, chunk: int = DEFAULT_CHUNK, repeats: int = 3) -> Measurement:
    """A TCP stream over 127.0.0.1 to a receiver process (TCP_NODELAY, autotuned socket buffers)."""
    return _socket_stream("tcp socket", socket.AF_INET, ("127.0.0.1", 0), nbytes, chunk, repeats)


def unix_socket(nbytes: int, chunk: int = DEFAULT_CHUNK, repeats: int = 3) -> Measurement:
    """An AF_UNIX stream socket (in a fresh temp dir) to a receiver process."""
    folder = tempfile.mkdtemp(prefix="epd-bench-")
    try:
        path = os.path.join(folder, "sink.sock")
        return _socket_stream("unix socket", socket.AF_UNIX, path, nbytes, chunk, repeats)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _tune(sock: socket.socket) -> None:
    """TCP_NODELAY; the buffers are left to the kernel's autotuning (asking for a size turns autotuning
    off, and Linux caps it at net.core.[rw]mem_max), so the reference is the faster socket. The bulk
    transport does the same (kvtransfer.bulk.tune)."""
    if sock.family == socket.AF_INET:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def _socket_stream(name: str, family: int, bind_to: Any, nbytes: int, chunk: int, repeats: int) -> Measurement:
    _check_args(nbytes, chunk, repeats)
    payload = _payload(nbytes)
    crc = zlib.crc32(payload)
    view = memoryview(payload)
    slices = [view[off:off + chunk] for off in range(0, nbytes, chunk)]
    best = float("inf")
    with _Child(_socket_receiver, family, bind_to, nbytes) as child:
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            _tune(sock)  # before connect, so the window scale reflects the buffer
            sock.settimeout(_IO_TIMEOUT_S)
            sock.connect(child.address)
            for _ in range(repeats):
                try:
                    t0 = time.perf_counter()
                    for piece in slices:
                        sock.sendall(piece)
                    ack = sock.recv(1)
                    seconds = time.perf_counter() - t0
                except OSError as exc:
                    child.raise_failure(f"{name}: {exc!r}")
                if ack != _ACK:
                    child.raise_failure(f"{name}: no ack from the receiver (got {ack!r})")
                child.verify(nbytes, crc)
                best = min(best, seconds)
    for piece in slices:
        piece.release()
    view.release()
    return Measurement(name, nbytes, best)


def tcp_round_trip(repeats: int = 200) -> float:
    """Median seconds of a one-byte ping-pong over 127.0.0.1 with a receiver process (TCP_NODELAY both
    ways): the least any request and its answer between two processes cost here."""
    if repeats < 1:
        raise ValueError(f"repeats must be at least 1, got {repeats}")
    times: list[float] = []
    with _Child(_echo_receiver, socket.AF_INET, ("127.0.0.1", 0)) as child:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            _tune(sock)
            sock.settimeout(_IO_TIMEOUT_S)
            sock.connect(child.address)
            for i in range(repeats + 10):  # the first 10 warm the path up
                t0 = time.perf_counter()
                try:
                    sock.sendall(b"x")
                    echo = sock.recv(1)
                except OSError as exc:
                    child.raise_failure(f"tcp round trip: {exc!r}")
                if echo != b"x":
                    child.raise_failure(f"tcp round trip: the receiver echoed {echo!r}")
                if i >= 10:
                    times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _accept_one(conn: Any, family: int, bind_to: Any) -> socket.socket:
    """Child: listen on ``bind_to``, tell the parent where ("ready"), and accept its one connection."""
    with socket.socket(family, socket.SOCK_STREAM) as listener:
        _tune(listener)  # accepted sockets inherit the buffers and TCP_NODELAY
        listener.bind(bind_to)
        listener.listen(1)
        listener.settimeout(_START_TIMEOUT_S)
        conn.send(("ready", listener.getsockname(), _heavy_modules()))
        peer, _ = listener.accept()
    return peer


def _echo_receiver(conn: Any, family: int, bind_to: Any) -> None:
    """Child: accept one connection and send back each byte until it closes."""
    with _accept_one(conn, family, bind_to) as peer:
        _tune(peer)
        peer.settimeout(_IO_TIMEOUT_S)
        while byte := peer.recv(1):
            peer.sendall(byte)
    _wait_for_stop(conn)


def _socket_receiver(conn: Any, family: int, bind_to: Any, nbytes: int) -> None:
    """Child: accept one connection, then per transfer ``recv_into`` nbytes, ack, and verify."""
    buf = bytearray(nbytes)  # allocated (and zero-filled, so faulted in) before anything is timed
    view = memoryview(buf)
    with _accept_one(conn, family, bind_to) as peer:
        peer.settimeout(_IO_TIMEOUT_S)
        while True:
            got = 0
            while got < nbytes:
                n = peer.recv_into(view[got:], nbytes - got)
                if n == 0:
                    break
                got += n
            if got == 0:  # the sender closed the connection between transfers: done
                break
            if got < nbytes:
                raise TransferCheckError(f"connection closed after {got} of {nbytes} bytes")
            peer.sendall(_ACK)
            if not _answer_verify(conn, got, zlib.crc32(view)):
                return
    view.release()
    _wait_for_stop(conn)


# ------------------------------------------------------------------------------------------- gRPC


def grpc_raw_stream(nbytes: int, chunk: int = DEFAULT_CHUNK, repeats: int = 3,
                    options: Sequence[tuple[str, Any]] = FAST_CHANNEL_OPTIONS) -> Measurement:
    """A gRPC client stream of pre-made ``bytes`` chunks, no (de)serialization on either end."""
    return _grpc_stream("grpc raw stream", False, nbytes, chunk, repeats, options)


def grpc_proto_bytes_stream(nbytes: int, chunk: int = DEFAULT_CHUNK, repeats: int = 3,
                            options: Sequence[tuple[str, Any]] = FAST_CHANNEL_OPTIONS) -> Measurement:
    """A gRPC client stream of ``google.protobuf.BytesValue`` messages, one chunk in each; the
    messages are built before timing, serialized and parsed by protobuf within it."""
    return _grpc_stream("grpc protobuf bytes stream", True, nbytes, chunk, repeats, options)


def _grpc_stream(name: str, proto: bool, nbytes: int, chunk: int, repeats: int,
                 options: Sequence[tuple[str, Any]]) -> Measurement:
    _check_args(nbytes, chunk, repeats)
    if chunk > MAX_MESSAGE_BYTES - 64:  # room for the protobuf framing
        raise ValueError(f"chunk must fit a {MAX_MESSAGE_BYTES}-byte message, got {chunk}")
    import grpc

    options = tuple(options)
    payload = _payload(nbytes)
    crc = zlib.crc32(payload)
    chunks = [bytes(payload[off:off + chunk]) for off in range(0, nbytes, chunk)]
    del payload
    requests: list[Any]
    if proto:
        from google.protobuf import wrappers_pb2

        requests = [wrappers_pb2.BytesValue(value=c) for c in chunks]
        serializer: Callable[[Any], bytes] | None = wrappers_pb2.BytesValue.SerializeToString
    else:
        requests, serializer = chunks, None
    best = float("inf")
    with _Child(_grpc_receiver, proto, options) as child:
        with grpc.insecure_channel(f"127.0.0.1:{child.address}", options=list(options)) as channel:
            grpc.channel_ready_future(channel).result(timeout=_START_TIMEOUT_S)
            call: grpc.StreamUnaryMultiCallable[Any, bytes] = channel.stream_unary(
                _FULL_METHOD, request_serializer=serializer, response_deserializer=None)
            # Warm-up with the first chunk alone: sets up the call path and the HTTP/2 stream machinery.
            _expect_count(call(iter(requests[:1]), timeout=_IO_TIMEOUT_S), len(chunks[0]), child, name)
            child.verify(len(chunks[0]), zlib.crc32(chunks[0]))
            for _ in range(repeats):
                try:
                    t0 = time.perf_counter()
                    reply = call(iter(requests), timeout=_IO_TIMEOUT_S)
                    seconds = time.perf_counter() - t0
                except grpc.RpcError as exc:
                    child.raise_failure(f"{name}: {exc!r}")
                _expect_count(reply, nbytes, child, name)
                child.verify(nbytes, crc)
                best = min(best, seconds)
    return Measurement(name, nbytes, best)


def _expect_count(reply: bytes, nbytes: int, child: _Child, name: str) -> None:
    if len(reply) != _COUNT.size or _COUNT.unpack(reply)[0] != nbytes:
        child.raise_failure(f"{name}: the server answered {reply!r}, expected a count of {nbytes}")


def _grpc_receiver(conn: Any, proto: bool, options: tuple[tuple[str, Any], ...]) -> None:
    """Child: a generic-handler gRPC server; each call's chunks are kept and checked on request."""
    import queue
    from concurrent import futures

    import grpc

    received: queue.Queue[list[bytes]] = queue.Queue()
    if proto:
        from google.protobuf import wrappers_pb2

        deserializer: Callable[[bytes], Any] | None = wrappers_pb2.BytesValue.FromString

        def data_of(message: Any) -> bytes:
            return message.value
    else:
        deserializer = None  # grpc hands the handler the raw message bytes

        def data_of(message: Any) -> bytes:
            return message

    def sink(request_iterator: Any, context: Any) -> bytes:
        kept, count = [], 0
        for message in request_iterator:
            data = data_of(message)
            count += len(data)
            kept.append(data)  # checked after the response, outside the client's timed window
        received.put(kept)
        return _COUNT.pack(count)

    handler = grpc.method_handlers_generic_handler(_SERVICE, {
        _METHOD: grpc.stream_unary_rpc_method_handler(sink, request_deserializer=deserializer,
                                                      response_serializer=None)})
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2), handlers=[handler], options=list(options))
    port = server.add_insecure_port("127.0.0.1:0")
    if port == 0:
        raise OSError("grpc could not bind 127.0.0.1:0")
    server.start()
    try:
        conn.send(("ready", port, _heavy_modules()))
        while True:
            if not conn.poll(_IO_TIMEOUT_S):
                raise TimeoutError("no word from the parent")
            message = conn.recv()
            if message[0] == "stop":
                return
            try:
                kept = received.get(timeout=_IO_TIMEOUT_S)
            except queue.Empty:
                raise TransferCheckError("asked to verify, but no call has completed") from None
            count, crc = 0, 0
            for data in kept:
                count += len(data)
                crc = zlib.crc32(data, crc)
            del kept
            _check(message, count, crc)
            conn.send(("ok", count, crc))
    finally:
        server.stop(grace=None).wait(_JOIN_TIMEOUT_S)


# ----------------------------------------------------------------------------------------- all


def measure_all(nbytes: int, repeats: int = 3) -> list[Measurement]:
    """Every reference, memcpy (torch's thread count) first; memcpy with 1 thread too if that differs."""
    results = [memcpy(nbytes, repeats)]
    if not results[0].name.startswith("memcpy (1 thread)"):
        results.append(memcpy(nbytes, repeats, threads=1))
    for fn in (tcp_socket, unix_socket, grpc_raw_stream, grpc_proto_bytes_stream):
        results.append(fn(nbytes, repeats=repeats))
    return results


def format_table(results: Sequence[Measurement]) -> str:
    """name, GB/s and the ratio to the first memcpy in ``results``."""
    reference = next((m for m in results if m.name.startswith("memcpy")), None)
    width = max(len("path"), *(len(m.name) for m in results))
    lines = [f"{'path':<{width}}  {'MiB':>7}  {'seconds':>8}  {'GB/s':>7}  {'x memcpy':>8}"]
    for m in results:
        ratio = f"{m.gbps / reference.gbps:8.3f}" if reference else f"{'-':>8}"
        lines.append(f"{m.name:<{width}}  {m.nbytes / MiB:7.1f}  {m.seconds:8.4f}  {m.gbps:7.2f}  {ratio}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_references", description=__doc__.split("\n")[0])
    parser.add_argument("--bytes", type=int, default=256 * MiB, help="bytes per transfer (default 256 MiB)")
    parser.add_argument("--repeats", type=int, default=3, help="best of this many transfers (default 3)")
    args = parser.parse_args(argv)
    results = measure_all(args.bytes, args.repeats)
    print(format_table(results))
    return 0


# ---------------------------------------------------------------------------------------- helpers


def _check_args(nbytes: int, chunk: int, repeats: int) -> None:
    if nbytes < 1:
        raise ValueError(f"nbytes must be >= 1, got {nbytes}")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    if repeats < 1:
        raise ValueError(f"repeats must be >= 1, got {repeats}")


def _payload(nbytes: int, seed: int = 0) -> bytearray:
    """``nbytes`` of seeded pseudo-random bytes (not periodic, so reordered chunks change the CRC)."""
    import numpy as np

    buf = bytearray(nbytes)
    np.frombuffer(buf, dtype=np.uint8)[:] = np.random.default_rng(seed).integers(0, 256, nbytes, dtype=np.uint8)
    return buf


_HEAVY = ("torch", "numpy")


def _heavy_modules() -> list[str]:
    return [name for name in _HEAVY if name in sys.modules]


def _check(message: tuple[Any, ...], count: int, crc: int) -> None:
    """Child side: compare what arrived with what the parent says it sent; raise (loudly) if it differs."""
    _, want_count, want_crc = message
    if count != want_count or crc != want_crc:
        raise TransferCheckError(f"receiver got {count} bytes with crc32 {crc:#010x}; "
                                 f"the sender sent {want_count} bytes with crc32 {want_crc:#010x}")


def _answer_verify(conn: Any, count: int, crc: int) -> bool:
    """Child side: wait for the parent's ("verify", count, crc) and answer it; False on ("stop",)."""
    if not conn.poll(_IO_TIMEOUT_S):
        raise TimeoutError("no word from the parent")
    message = conn.recv()
    if message[0] == "stop":
        return False
    _check(message, count, crc)
    conn.send(("ok", count, crc))
    return True


def _wait_for_stop(conn: Any) -> None:
    while conn.poll(_IO_TIMEOUT_S):
        if conn.recv()[0] == "stop":
            return


def _child_main(target: Callable[..., None], conn: Any, *args: Any) -> None:
    """Entry point of every receiver process: failures go to the parent (and stderr, exit code 1)."""
    try:
        target(conn, *args)
    except BaseException:
        try:
            conn.send(("error", traceback.format_exc()))
        except OSError:
            pass
        raise
    finally:
        conn.close()


class _Child:
    """A receiver process (spawn) with a duplex pipe; never outlives the ``with`` block."""

    def __init__(self, target: Callable[..., None], *args: Any) -> None:
        ctx = multiprocessing.get_context("spawn")
        self._conn, child_conn = ctx.Pipe(duplex=True)
        self._process = ctx.Process(target=_child_main, args=(target, child_conn, *args), daemon=True,
                                    name=f"epd-bench-{target.__name__.strip('_')}")
        self._child_conn = child_conn
        self.address: Any = None
        self.heavy_modules: list[str] = []

    def __enter__(self) -> _Child:
        try:
            self._process.start()
            self._child_conn.close()
            _, self.address, self.heavy_modules = self._receive("ready", _START_TIMEOUT_S)
        except BaseException:
            self._shut_down()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self._shut_down()

    def verify(self, count: int, crc: int) -> int:
        """Ask the receiver to check its last transfer against ``count`` bytes with ``crc``."""
        try:
            self._conn.send(("verify", count, crc))
        except OSError:  # the receiver has exited; its last report is still in the pipe
            pass
        _, got, _ = self._receive("ok", _IO_TIMEOUT_S)
        if got != count:
            raise TransferCheckError(f"receiver confirmed {got} bytes, expected {count}")
        return got

    def raise_failure(self, what: str) -> NoReturn:
        """Raise with the receiver's own error report if it sent one."""
        detail = ""
        if self._conn.poll(5.0):
            try:
                message = self._conn.recv()
                detail = f"\nreceiver: {message[1] if message[0] == 'error' else message!r}"
            except EOFError:
                detail = f"\nreceiver exited with code {self._process.exitcode}"
        raise TransferCheckError(what + detail)

    def _receive(self, kind: str, timeout: float) -> tuple[Any, ...]:
        if not self._conn.poll(timeout):
            raise TransferCheckError(f"receiver {self._process.name} sent nothing for {timeout:.0f} s")
        try:
            message = self._conn.recv()
        except EOFError:
            self._process.join(_JOIN_TIMEOUT_S)
            raise TransferCheckError(f"receiver {self._process.name} exited (code {self._process.exitcode})"
                                     ) from None
        if message[0] == "error":
            raise TransferCheckError(f"receiver {self._process.name} failed:\n{message[1]}")
        if message[0] != kind:
            raise TransferCheckError(f"receiver {self._process.name} sent {message!r}, expected {kind!r}")
        return message

    def _shut_down(self) -> None:
        if self._conn.closed:
            return
        try:
            if self._process.pid is not None:
                try:
                    self._conn.send(("stop",))
                except OSError:  # the child is gone already
                    pass
                self._process.join(_JOIN_TIMEOUT_S)
                if self._process.is_alive():
                    self._process.terminate()
                    self._process.join(_JOIN_TIMEOUT_S)
                if self._process.is_alive():
                    self._process.kill()
                    self._process.join()
                self._process.close()
        finally:
            self._conn.close()
            self._child_conn.close()


if __name__ == "__main__":
    sys.exit(main())
