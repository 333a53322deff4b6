"""The ingress's HTTP/1.1 protocol: uvicorn's httptools protocol with a bound on each request's head.

uvicorn's httptools protocol takes a request head of any size, over any time: one client sending a header
that never ends made the server buffer hundreds of MiB, parsing it held the event loop for minutes (every
other request waited), and connections that trickle a head, or send nothing at all, stayed open for good.
Here a request's line and headers must come to at most ``MAX_HEAD_BYTES`` and arrive within
``HEAD_TIMEOUT_S`` of its first byte (of the connection, for its first request): past the size the client
gets 431, past the time 408, and the connection is closed. A body is bounded by rate, as Apache's
mod_reqtimeout does (``body=30,MinRate=1000``): it has ``BODY_GRACE_S`` from the end of its head, plus a second
for each ``BODY_MIN_RATE`` bytes received; past that the client gets 408 (when no response has begun) and the
connection is closed. Time the server itself holds the body back (the app has not read what came, or has not
yet asked for it under ``Expect: 100-continue``) is not counted. Passed to uvicorn as its ``http`` protocol
class (``Config(http=...)``).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time

import uvicorn
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

log = logging.getLogger(__name__)

MAX_HEAD_BYTES = 64 * 1024
HEAD_TIMEOUT_S = 30.0
BODY_GRACE_S = 30.0
BODY_MIN_RATE = 1000  # bytes a second, on average, once the grace is spent
_REFUSALS = {431: b"HTTP/1.1 431 Request Header Fields Too Large\r\n", 408: b"HTTP/1.1 408 Request Timeout\r\n"}


class BoundedHeadHttpTools(HttpToolsProtocol):
    _head_bytes = 0
    _in_head = True
    _began = _ended = False  # a request began, or one ended, in the data being parsed
    _head_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _body_deadline = 0.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._disarm_body()
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
        self._disarm_body()
        super().on_message_complete()

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._disarm()
        before = self.cycle
        super().on_headers_complete()
        if self.cycle is before:  # no request cycle began: a protocol upgrade
            return
        loop = asyncio.get_running_loop()
        self._body_deadline = loop.time() + BODY_GRACE_S  # on_message_complete disarms it at once when bodiless
        self._body_timer = loop.call_at(self._body_deadline, self._body_timed_out)

    def on_body(self, body: bytes) -> None:
        self._body_deadline += len(body) / BODY_MIN_RATE
        super().on_body(body)

    def _arm(self) -> None:
        self._disarm()
        self._head_timer = asyncio.get_running_loop().call_later(HEAD_TIMEOUT_S, self._head_timed_out)

    def _disarm(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _disarm_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_timed_out(self) -> None:
        loop = asyncio.get_running_loop()
        self._body_timer = None
        cycle = self.cycle
        if self.transport.is_closing() or cycle is None:
            return
        if self.flow.read_paused or cycle.waiting_for_100_continue:  # the server holds it back, not the client
            self._body_deadline = max(self._body_deadline, loop.time() + BODY_GRACE_S)
        if loop.time() < self._body_deadline:  # bytes came since the timer was set
            self._body_timer = loop.call_at(self._body_deadline, self._body_timed_out)
            return
        # an answer already begun (the app did not want the body) is left as it is, and so is an earlier
        # request's still being written ahead of this one (pipelined behind it)
        self._refuse(408, f"a request body slower than {BODY_MIN_RATE} bytes/s after {BODY_GRACE_S:g} s",
                     answer=not cycle.response_started and not self.pipeline)

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._in_head and not self.transport.is_closing():
            self._refuse(408, f"a request head not complete within {HEAD_TIMEOUT_S:g} s")

    def _refuse(self, status: int, why: str, answer: bool | None = None) -> None:
        """Close the connection, first answering ``status`` unless ``answer`` is False; by default, when no
        earlier response is still being written on it."""
        self._disarm()
        self._disarm_body()
        log.warning("closing a connection from %s: %s", self.client, why)
        if answer is None:
            answer = self.cycle is None or self.cycle.response_complete
        if answer:
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


def server_config(app: object, *, keep_alive_s: int, **kwargs: object) -> uvicorn.Config:
    """uvicorn's ``Config`` as ``epd serve`` runs it: this module's protocol, and idle kept-alive connections
    closed after ``keep_alive_s`` (``api.keep_alive_s``). uvicorn's own default, 5 s, equals the expiry of
    httpx's pool (the OpenAI SDK's client) and is under aiohttp's 15 s, so a client reusing a connection at
    about that idle time could send its request just as the server closed it, and get "Server
    disconnected without sending a response". The server must keep a connection longer than its clients."""
    return uvicorn.Config(app, http=BoundedHeadHttpTools, timeout_keep_alive=keep_alive_s, **kwargs)  # type: ignore[arg-type]
