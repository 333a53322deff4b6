"""The ingress's HTTP/1.1 protocol: uvicorn's httptools protocol with a bound on each request's head.

uvicorn's httptools protocol takes a request head of any size, over any time: one client sending a header
that never ends made the server buffer hundreds of MiB, parsing it held the event loop for minutes (every
other request waited), and connections that trickle a head, or send nothing at all, stayed open for good.
Here a request's line and headers must come to at most ``MAX_HEAD_BYTES`` and arrive within
``HEAD_TIMEOUT_S`` of its first byte (of the connection, for its first request): past the size the client
gets 431, past the time 408, and the connection is closed. A slow body is not bounded here; it needs a valid
API key, checked before the body is read. Passed to uvicorn as its ``http`` protocol class (``Config(http=...)``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0
_REFUSALS = {431: b"HTTP/1.1 431 Request Header Fields Too Large\r\n", 408: b"HTTP/1.1 408 Request Timeout\r\n"}


class BoundedHeadHttpTools(HttpToolsProtocol):
    _head_bytes = 0
    _in_head = True
    _began = _ended = False  # a request began, or one ended, in the data being parsed
    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        self._began = self._ended = False
        super().data_received(data)
        # data that did not finish this head is all head, unless it also ended an earlier request (then its
        # start was that request's body, and the next data counts)
        if self._in_head and not (self._began and self._ended) and not self.transport.is_closing():
            self._head_bytes += len(data)
            if self._head_bytes > MAX_HEAD_BYTES:
                self._refuse(431, f"a request head over {MAX_HEAD_BYTES // 1024} KiB")

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._began = True
        if not self._in_head:  # the next request on a kept-alive connection: its head is bounded afresh
            self._in_head, self._head_bytes = True, 0
            self._arm()

    def on_message_complete(self) -> None:
        self._ended = True
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        super().on_headers_complete()

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(408, f"a request head not complete within {HEAD_TIMEOUT_S:g} s")

    def _refuse(self, status: int, why: str) -> None:
        self._disarm()
        log.warning("closing a connection from %s: %s", self.client, why)
        if self.cycle is None or self.cycle.response_complete:  # no earlier response still being written on it
            body = why.encode()
            self.transport.write(_REFUSALS[status] + b"content-type: text/plain; charset=utf-8\r\n"
                                 + b"content-length: %d\r\nconnection: close\r\n\r\n" % len(body) + body)
        self.transport.close()


class RepeatsLimited(logging.Filter):
    """Passes each of ``messages`` at most once per ``interval_s``, saying how many were held back since: uvicorn
    logs one warning per malformed request ("Invalid HTTP request received."), so a client sending garbage
    could fill the log. Other records pass untouched."""

    def __init__(self, messages: tuple[str, ...], interval_s: float = 10.0) -> None:
        super().__init__()
        self.messages, self.interval_s = messages, interval_s
        self._last: dict[str, float] = {}
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if text not in self.messages:
            return True
        now = time.monotonic()
        with self._lock:
            if now - self._last.get(text, -self.interval_s) < self.interval_s:
                self._held[text] = self._held.get(text, 0) + 1
                return False
            self._last[text] = now
            held = self._held.pop(text, 0)
        if held:
            record.msg, record.args = f"{text} ({held} more held back in the {self.interval_s:g} s before)", None
        return True


def limit_repeated_warnings() -> None:
    """Attach ``RepeatsLimited`` to uvicorn's error logger, once."""
    logger = logging.getLogger("uvicorn.error")
    if not any(isinstance(f, RepeatsLimited) for f in logger.filters):
        logger.addFilter(RepeatsLimited(("Invalid HTTP request received.",)))
