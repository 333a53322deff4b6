"""A minimal HTTP/1.1 keep-alive client for load generation: one pre-encoded POST, replies with a
Content-Length body, nothing else.

Why not httpx: its CPU per request is a large share of what the stack under test spends, and a load
generator that shares the cores with the stack measures itself. This client does as little per request
as wrk or oha would. It speaks only what the
control-plane benchmark sends and receives: a JSON POST on a persistent connection and a reply framed by
Content-Length (anything else, chunked or unframed, is refused with a message saying so).
"""

from __future__ import annotations

import asyncio
import json
import socket
from dataclasses import dataclass
from typing import Any

MAX_HEAD_BYTES = 64 * 1024


class LeanHTTPError(RuntimeError):
    """A reply this client cannot read (it names what was wrong)."""


@dataclass(frozen=True)
class Reply:
    status: int
    headers: dict[str, str]  # lower-case names
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


def post_bytes(host: str, port: int, path: str, payload: dict[str, Any]) -> bytes:
    """The whole request, encoded once and sent as many times as needed."""
    body = json.dumps(payload).encode()
    return (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def parse_head(head: bytes) -> tuple[int, dict[str, str], int]:
    """(status, headers, body length) of a reply head ending in CRLF CRLF."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split(" ", 2)
    if len(parts) < 2 or not parts[0].startswith("HTTP/1.") or not parts[1].isdigit():
        raise LeanHTTPError(f"not an HTTP/1.x status line: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if line:
            name, sep, value = line.partition(":")
            if not sep:
                raise LeanHTTPError(f"malformed header line: {line[:80]!r}")
            headers[name.strip().lower()] = value.strip()
    if "chunked" in headers.get("transfer-encoding", "").lower():
        raise LeanHTTPError("the reply is chunked; this client reads Content-Length bodies only")
    length = headers.get("content-length")
    if length is None or not length.isdigit():
        raise LeanHTTPError(f"the reply has no usable Content-Length ({length!r})")
    return int(parts[1]), headers, int(length)


class Connection:
    """One blocking keep-alive connection."""

    def __init__(self, host: str, port: int, timeout_s: float = 60.0) -> None:
        self.sock = socket.create_connection((host, port), timeout=timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = b""

    def send(self, request: bytes) -> Reply:
        self.sock.sendall(request)
        while (end := self._buf.find(b"\r\n\r\n")) < 0:
            self._fill()
        status, headers, length = parse_head(self._buf[:end + 4])
        self._buf = self._buf[end + 4:]
        while len(self._buf) < length:
            self._fill()
        body, self._buf = self._buf[:length], self._buf[length:]
        return Reply(status, headers, body)

    def _fill(self) -> None:
        data = self.sock.recv(65536)
        if not data:
            raise LeanHTTPError("the server closed the connection mid-reply")
        self._buf += data
        if len(self._buf) > MAX_HEAD_BYTES and self._buf.find(b"\r\n\r\n") < 0:
            raise LeanHTTPError(f"no end of the reply head in {len(self._buf)} bytes")

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> Connection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


async def send_async(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, request: bytes) -> Reply:
    """The same exchange on an asyncio connection (``asyncio.open_connection``)."""
    writer.write(request)
    try:
        head = await reader.readuntil(b"\r\n\r\n")
    except asyncio.LimitOverrunError:
        raise LeanHTTPError("the reply head is too long") from None
    except asyncio.IncompleteReadError:
        raise LeanHTTPError("the server closed the connection mid-reply") from None
    status, headers, length = parse_head(head)
    try:
        body = await reader.readexactly(length)
    except asyncio.IncompleteReadError:
        raise LeanHTTPError("the server closed the connection mid-reply") from None
    return Reply(status, headers, body)
