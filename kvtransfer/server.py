"""Hosting the KVTransfer service: raw-bytes method handlers (framing is ours, see wire.py) behind
the authentication interceptor, on a thread-pool gRPC server."""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from concurrent import futures

import grpc

from kvtransfer.auth import TransferSecurity
from kvtransfer.codecs import native
from kvtransfer.memory import retain_freed_buffers
from kvtransfer.options import CHANNEL_OPTIONS, server_stream_options
from kvtransfer.receiver import KVReceiver
from kvtransfer.wire import SERVICE


def kv_transfer_handler(receiver: KVReceiver) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(receiver.push),
        "OpenBulk": grpc.unary_unary_rpc_method_handler(receiver.open_bulk),
        "OpenCudaIpc": grpc.unary_unary_rpc_method_handler(receiver.open_cuda_ipc),
    })


def handler_pool(max_workers: int, prefix: str) -> futures.ThreadPoolExecutor:
    """A gRPC server's handler pool with every thread started now. grpcio's serving thread hands each call
    to the pool, and a hand-off that has to start a thread and cannot (a pids limit, no address space left)
    raises there and ends that serving thread for good: the server still accepts connections and answers
    nothing, while the process looks alive. Started up front, the pool never starts a thread later, and a
    process that cannot get its threads fails here, at start, where it is seen."""
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix=prefix)
    gate = threading.Barrier(max_workers + 1)
    try:
        for _ in range(max_workers):  # each blocks on the gate, so the next one needs a new thread
            pool.submit(gate.wait, 60)
        gate.wait(60)
    except BaseException:
        gate.abort()
        pool.shutdown(wait=False, cancel_futures=True)
        raise
    return pool


@contextlib.contextmanager
def released_on_failure(pool: futures.ThreadPoolExecutor) -> Iterator[None]:
    """Around a server's set-up and start: if they fail (a port in use, say), its handler threads go too."""
    try:
        yield
    except BaseException:
        pool.shutdown(wait=False)
        raise


def start_server(handlers: list[grpc.GenericRpcHandler], address: str, security: TransferSecurity,
                 max_streams: int = 64) -> tuple[grpc.Server, int]:
    """Start a server on ``address`` (port 0 picks one); returns it and its port.

    Each open stream holds a handler thread, so the pool has a thread for every stream HTTP/2 lets
    a client open (``max_streams``): a stream without a thread would fill the connection's
    flow-control window with unread bytes and stall every other stream on that connection."""
    retain_freed_buffers()  # grpcio hands each received message over as a fresh multi-MiB bytes object
    native.load_in_background()  # the receiver dequantises int8 with them
    pool = handler_pool(max_streams + 8, "kvtransfer")
    server = grpc.server(pool, interceptors=security.interceptors(),
                         options=CHANNEL_OPTIONS + server_stream_options(max_streams))
    with released_on_failure(pool):
        server.add_generic_rpc_handlers(tuple(handlers))
        port = security.add_port(server, address)
        server.start()
    return server, port
