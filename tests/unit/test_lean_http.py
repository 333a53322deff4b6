"""The bench's lean HTTP client: reply heads are parsed exactly, and anything it cannot frame is refused
by name (it never guesses where a body ends). The round trip against a real server is in
tests/integration/test_controlplane_bench.py."""

from __future__ import annotations

import socket
import threading

import pytest

from bench.lean_http import Connection, LeanHTTPError, parse_head, post_bytes

pytestmark = [pytest.mark.unit]


def test_a_head_gives_status_lowercase_headers_and_length() -> None:
    status, headers, length = parse_head(b"HTTP/1.1 429 Too Many Requests\r\nContent-Length: 12\r\n"
                                         b"Server-Timing: engine;dur=3.5\r\nRetry-After: 1\r\n\r\n")
    assert (status, length) == (429, 12)
    assert headers == {"content-length": "12", "server-timing": "engine;dur=3.5", "retry-after": "1"}


@pytest.mark.parametrize("head, says", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n", "chunked"),
    (b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\n\r\n", "Content-Length"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "status line"),
    (b"HTTP/1.1 200 OK\r\nno colon here\r\n\r\n", "malformed header"),
])
def test_a_reply_it_cannot_frame_is_refused_by_name(head: bytes, says: str) -> None:
    with pytest.raises(LeanHTTPError, match=says):
        parse_head(head)


def test_requests_and_replies_round_trip_on_one_connection_even_when_split() -> None:
    """Two requests on one keep-alive connection; the server writes each reply in two pieces."""
    srv = socket.create_server(("127.0.0.1", 0))
    port = srv.getsockname()[1]
    seen: list[bytes] = []

    def serve() -> None:
        conn, _ = srv.accept()
        with conn:
            for body in (b'{"a": 1}', b'{"b": 22}'):
                data = b""
                while b"\r\n\r\n" not in data or not data.endswith(b"}"):
                    data += conn.recv(4096)
                seen.append(data)
                reply = b"HTTP/1.1 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body
                conn.sendall(reply[:20])
                conn.sendall(reply[20:])

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    request = post_bytes("127.0.0.1", port, "/v1/x", {"k": "v"})
    with Connection("127.0.0.1", port, timeout_s=10) as conn:
        first, second = conn.send(request), conn.send(request)
    t.join(10)
    srv.close()
    assert (first.status, first.json(), second.json()) == (200, {"a": 1}, {"b": 22})
    assert seen == [request, request]
    assert request.endswith(b'{"k": "v"}') and b"Content-Length: 10\r\n" in request
