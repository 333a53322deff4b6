"""Hosting the KVTransfer service: raw-bytes method handlers (framing is ours, see wire.py) behind
the authentication interceptor, on a thread-pool gRPC server."""

from __future__ import annotations

from concurrent import futures

import grpc

from kvtransfer.auth import TransferSecurity
from kvtransfer.options import CHANNEL_OPTIONS
from kvtransfer.receiver import KVReceiver
from kvtransfer.wire import SERVICE


def kv_transfer_handler(receiver: KVReceiver) -> grpc.GenericRpcHandler:
    return grpc.method_handlers_generic_handler(SERVICE, {
        "Push": grpc.stream_unary_rpc_method_handler(receiver.push),
    })


def start_server(handlers: list[grpc.GenericRpcHandler], address: str, security: TransferSecurity,
                 max_workers: int = 16) -> tuple[grpc.Server, int]:
    """Start a server on ``address`` (port 0 picks one); returns it and its port."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="kvtransfer"),
                         interceptors=security.interceptors(), options=CHANNEL_OPTIONS)
    server.add_generic_rpc_handlers(tuple(handlers))
    port = security.add_port(server, address)
    server.start()
    return server, port
