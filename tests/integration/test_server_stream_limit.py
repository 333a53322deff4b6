"""A worker's gRPC server refuses no call its clients may make, and keeps answering when the process cannot
start another thread. Clients keep to the server's advertised
stream limit (queueing past it); grpc's overload protection would also count streams already closed on the
wire whose call the server process has not released yet, and refuse new ones with RST_STREAM REFUSED_STREAM.
Under load (a busy worker releasing calls late) that turned a burst past ~64 requests into "decode worker
lost" and 503s. Here the server keeps every call's context alive, so released-late is certain."""

from __future__ import annotations

import secrets
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from kvtransfer.auth import TransferSecurity
from kvtransfer.server import start_server
from workers.service_base import start_worker_server

from proc_helpers import refuse_thread_starts

pytestmark = [pytest.mark.integration]
SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
MAX_STREAMS = 2


def _kept_calls_handler(kept: list[grpc.ServicerContext]) -> grpc.GenericRpcHandler:
    def echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        kept.append(context)  # the call stays referenced after it ends: its stream is released late
        return request
    return grpc.method_handlers_generic_handler("test.Kept", {"Echo": grpc.unary_unary_rpc_method_handler(echo)})


@pytest.mark.parametrize("start", [
    lambda handler: start_worker_server([], [handler], "127.0.0.1:0", SECURITY, max_streams=MAX_STREAMS),
    lambda handler: start_server([handler], "127.0.0.1:0", SECURITY, max_streams=MAX_STREAMS),
], ids=["worker-server", "kv-server"])
def test_calls_past_the_stream_limit_whose_streams_are_released_late_are_served(
        start: Callable[[grpc.GenericRpcHandler], tuple[grpc.Server, int]]) -> None:
    kept: list[grpc.ServicerContext] = []
    server, port = start(_kept_calls_handler(kept))
    try:
        with SECURITY.open_channel(f"127.0.0.1:{port}") as channel:
            echo: grpc.UnaryUnaryMultiCallable = channel.unary_unary("/test.Kept/Echo")
            for i in range(5 * (MAX_STREAMS + 8)):  # well past the limit, one call at a time
                assert echo(b"%d" % i, metadata=SECURITY.call_metadata(), timeout=10) == b"%d" % i
        assert len(kept) == 5 * (MAX_STREAMS + 8)
    finally:
        server.stop(0)
        kept.clear()


@pytest.mark.parametrize("start, prefix", [
    (lambda handler: start_worker_server([], [handler], "127.0.0.1:0", SECURITY, max_streams=MAX_STREAMS), "worker"),
    (lambda handler: start_server([handler], "127.0.0.1:0", SECURITY, max_streams=MAX_STREAMS), "kvtransfer"),
], ids=["worker-server", "kv-server"])
def test_a_server_keeps_answering_when_no_thread_can_start(
        start: Callable[[grpc.GenericRpcHandler], tuple[grpc.Server, int]], prefix: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A pids limit (or no address space) refuses new threads for a while. A handler pool that started its
    threads only when calls came needed one for the first busy moment, the refusal ended grpcio's serving
    thread, and the server answered nothing ever after, while the process looked alive. Here every start of
    a handler thread fails once the server is up, and two bursts of calls, 8 at a time, are all answered."""
    def slow_echo(request: bytes, context: grpc.ServicerContext) -> bytes:
        time.sleep(0.01)  # so a burst finds every handler thread busy
        return request
    handler = grpc.method_handlers_generic_handler("test.Slow",
                                                   {"Echo": grpc.unary_unary_rpc_method_handler(slow_echo)})
    server, port = start(handler)
    refuse_thread_starts(monkeypatch, prefix)
    try:
        with SECURITY.open_channel(f"127.0.0.1:{port}") as channel, ThreadPoolExecutor(8) as clients:
            echo: grpc.UnaryUnaryMultiCallable = channel.unary_unary("/test.Slow/Echo")
            for burst in range(2):
                calls = [clients.submit(echo, b"%d" % i, metadata=SECURITY.call_metadata(), timeout=10)
                         for i in range(3 * (MAX_STREAMS + 16))]
                assert [c.result() for c in calls] == [b"%d" % i for i in range(3 * (MAX_STREAMS + 16))], burst
    finally:
        monkeypatch.undo()
        server.stop(0)
