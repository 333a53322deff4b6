"""The ingress bounds each request's head (controlplane.api.http_protocol): a head past 64 KiB gets 431 and a
head not complete within its time limit gets 408, the connection closed either way, while the server keeps
answering everyone else at once. A body slower than the minimum rate after its grace gets 408 too; time the
server holds a body back is not counted. Bodies, pipelined requests and kept-alive connections pass as
before. Real uvicorn on a loopback socket; raw sockets play the clients."""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from collections.abc import AsyncIterator, Iterator

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

import controlplane.api.http_protocol as http_protocol

from http_helpers import serve_app

pytestmark = pytest.mark.unit


def _app() -> FastAPI:
    app = FastAPI()

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    @app.post("/late")  # reads its body only after 2.5 s: the server, not the client, holds it back meanwhile
    async def late(request: Request) -> dict:
        await asyncio.sleep(2.5)
        return {"bytes": len(await request.body())}

    @app.get("/ping")
    async def ping() -> dict:
        return {"ok": True}

    @app.get("/stream")  # 12 lines over 3 s (StreamingResponse listens for the client leaving meanwhile)
    async def stream() -> StreamingResponse:
        async def lines() -> AsyncIterator[bytes]:
            for i in range(12):
                yield b"line %d\n" % i
                await asyncio.sleep(0.25)
        return StreamingResponse(lines(), media_type="text/plain")
    return app


@pytest.fixture
def server(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[str, int]]:
    monkeypatch.setattr(http_protocol, "HEAD_TIMEOUT_S", 1.0)
    monkeypatch.setattr(http_protocol, "BODY_GRACE_S", 1.0)
    monkeypatch.setattr(http_protocol, "BODY_MIN_RATE", 100_000)  # bytes/s: a second per 100 kB after the grace
    with serve_app(_app()) as url:
        host, port = url.removeprefix("http://").split(":")
        yield host, int(port)


def _read_to_close(sock: socket.socket) -> bytes:
    """What the server sends until it closes (or the socket's timeout passes, or it resets)."""
    out = b""
    try:
        while chunk := sock.recv(65536):
            out += chunk
    except (TimeoutError, ConnectionResetError):
        pass
    return out


def _exchange(addr: tuple[str, int], data: bytes, wait_s: float = 5.0) -> bytes:
    """Send ``data``, then read until the server closes (or ``wait_s`` passes)."""
    with socket.create_connection(addr, timeout=wait_s) as sock:
        sock.sendall(data)
        return _read_to_close(sock)


def _ping(addr: tuple[str, int]) -> float:
    began = time.monotonic()
    reply = _exchange(addr, b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200"), reply
    return time.monotonic() - began


def test_a_head_past_the_bound_gets_431_and_others_are_served(server: tuple[str, int]) -> None:
    with socket.create_connection(server, timeout=10) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: ")
        sent = 0
        try:
            while sent < 8 * 2**20:  # a header that never ends: cut off well before this
                sock.sendall(b"A" * 65536)
                sent += 65536
        except (BrokenPipeError, ConnectionResetError):
            pass
        assert sent < 4 * 2**20, "the server read on past the bound"
        assert _ping(server) < 2.0  # and everyone else is served at once
    reply = _exchange(server, b"GET /ping HTTP/1.1\r\nHost: x\r\nX-Big: " + b"A" * 100_000)
    assert reply.startswith(b"HTTP/1.1 431") and b"a request head over 64 KiB" in reply, reply[:200]
    assert _ping(server) < 2.0


def test_a_head_that_trickles_past_its_time_gets_408(server: tuple[str, int]) -> None:
    with socket.create_connection(server, timeout=10) as sock:
        began = time.monotonic()
        sock.sendall(b"GET /ping HTTP/1.1\r\n")
        reply = b""
        while chunk := sock.recv(65536):
            reply += chunk
            time.sleep(0.01)
        assert reply.startswith(b"HTTP/1.1 408") and 0.8 < time.monotonic() - began < 5, reply
    silent = socket.create_connection(server, timeout=10)  # nothing sent at all: closed at the limit too
    assert silent.recv(65536).startswith(b"HTTP/1.1 408")
    silent.close()


def test_bodies_pipelining_and_kept_alive_connections_pass(server: tuple[str, int]) -> None:
    body = b"x" * (3 * 2**20)  # far past the head bound, in the same writes as its head
    reply = _exchange(server, b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/octet-stream\r\n"
                              b"Content-Length: %d\r\nConnection: close\r\n\r\n" % len(body) + body)
    assert reply.startswith(b"HTTP/1.1 200") and b'{"bytes":3145728}' in reply
    pipelined = (b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100000\r\n\r\n" + b"y" * 100000) * 3 \
        + b"GET /ping HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    reply = _exchange(server, pipelined)
    assert reply.count(b"HTTP/1.1 200") == 4 and reply.count(b'{"bytes":100000}') == 3
    with socket.create_connection(server, timeout=10) as sock:  # one connection, requests 0.6 s apart:
        for _ in range(3):  # each head is timed from its own first byte, not from the connection's start
            sock.sendall(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n")
            assert sock.recv(65536).startswith(b"HTTP/1.1 200")
            time.sleep(0.6)


def test_garbage_connections_log_their_warning_once_per_interval(server: tuple[str, int],
                                                                 caplog: pytest.LogCaptureFixture) -> None:
    """uvicorn logs a warning per malformed request; a client sending garbage could fill the log. With the
    filter epd serve attaches, 50 of them log one line, and the next one past the interval says how many were
    held back."""
    http_protocol.limit_repeated_warnings()
    limiter = next(f for f in logging.getLogger("uvicorn.error").filters
                   if isinstance(f, http_protocol.RepeatsLimited))
    limiter._last.clear()
    with caplog.at_level(logging.WARNING, logger="uvicorn.error"):
        for _ in range(50):
            assert _exchange(server, b"\x16\x03\x01 not http at all\r\n\r\n").startswith(b"HTTP/1.1 400")
        said = [r.getMessage() for r in caplog.records if "Invalid HTTP request" in r.getMessage()]
        assert said == ["Invalid HTTP request received."]
        limiter._last.clear()  # as if the interval had passed
        _exchange(server, b"garbage\r\n\r\n")
        said = [r.getMessage() for r in caplog.records if "Invalid HTTP request" in r.getMessage()]
        assert said[-1] == "Invalid HTTP request received. (49 more held back in the 10 s before)"


def _trickle(addr: tuple[str, int], path: str, parts: list[bytes], gap_s: float) -> tuple[bytes, float]:
    """POST ``parts`` as one body (its length declared), ``gap_s`` apart; the reply and when it came."""
    length = sum(len(p) for p in parts)
    with socket.create_connection(addr, timeout=15) as sock:
        began = time.monotonic()
        sock.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\nConnection: close\r\n\r\n"
                     % (path.encode(), length))
        try:
            for part in parts:
                time.sleep(gap_s)
                sock.sendall(part)
        except (BrokenPipeError, ConnectionResetError):
            pass
        return _read_to_close(sock), time.monotonic() - began


def test_a_body_slower_than_the_minimum_rate_gets_408(server: tuple[str, int]) -> None:
    reply, took = _trickle(server, "/echo", [b"z"] * 40, 0.1)  # 10 bytes/s: cut off at the 1 s grace
    assert reply.startswith(b"HTTP/1.1 408") and b"request body slower than" in reply, reply[:200]
    assert took < 3.0
    assert _ping(server) < 2.0
    # 100 kB every 0.5 s (200 kB/s, past the minimum rate) over 3 s, well past the grace: served
    reply, took = _trickle(server, "/echo", [b"z" * 100_000] * 6, 0.5)
    assert reply.startswith(b"HTTP/1.1 200") and b'{"bytes":600000}' in reply and took > 2.5, reply[:200]


def test_a_body_the_server_holds_back_is_not_the_clients_fault(server: tuple[str, int],
                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """The app reads the body 2.5 s in (past the grace): what the client sent meanwhile waits in the kernel
    (the server pauses reading past 64 KiB buffered), and the client is not cut off for it."""
    monkeypatch.setattr(http_protocol, "BODY_MIN_RATE", 10**12)  # bytes received buy no time
    reply, _ = _trickle(server, "/late", [b"w" * 2_000_000], 0.0)
    assert reply.startswith(b"HTTP/1.1 200") and b'{"bytes":2000000}' in reply, reply[:200]


def test_a_slow_body_pipelined_behind_a_stream_never_writes_into_it(server: tuple[str, int]) -> None:
    """A request whose body is too slow, pipelined behind a streamed answer still being written, is cut off
    without a 408 of its own: one written there would land in the middle of the earlier answer."""
    with socket.create_connection(server, timeout=15) as sock:
        sock.sendall(b"GET /stream HTTP/1.1\r\nHost: x\r\n\r\n"
                     b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\nz")  # 99 bytes never come
        reply = _read_to_close(sock)
    assert b"408" not in reply and reply.startswith(b"HTTP/1.1 200"), reply[-300:]
    assert b"line 0" in reply


def test_an_idle_kept_alive_connection_outlives_the_clients_pool_expiry() -> None:
    """A connection left idle past httpx's pool expiry (5 s, uvicorn's own default keep-alive) still takes
    the next request: with both at 5 s a client's reused connection could close under its request
    ("Server disconnected without sending a response", seen once in a 15-minute soak)."""
    with serve_app(_app()) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as sock:
            ping = f"GET /ping HTTP/1.1\r\nHost: {host}\r\n\r\n".encode()
            sock.sendall(ping)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200")
            time.sleep(6.0)  # past 5 s: uvicorn's default would have closed it by now
            sock.sendall(ping)
            assert sock.recv(4096).startswith(b"HTTP/1.1 200"), "the server closed the idle connection"
