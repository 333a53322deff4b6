"""Serve an ASGI app with uvicorn on a free loopback port, in a thread of the test process; free ports."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import uvicorn

from controlplane.api.http_protocol import server_config
from controlplane.settings import ApiSettings


def free_loopback_port() -> int:
    """A loopback port free now (the kernel's choice), for a server a test starts by port number."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_app(app: Any, start_timeout_s: float = 20.0) -> Iterator[str]:
    """Yields the base URL (http://127.0.0.1:PORT); stops the server on exit. uvicorn leaves signals alone
    off the main thread, so the test runner keeps its own."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(server_config(app, keep_alive_s=ApiSettings().keep_alive_s, log_level="warning",
                                          lifespan="off", ws="none", timeout_graceful_shutdown=5))  # as epd serve
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, name="uvicorn", daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + start_timeout_s
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.02)
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        thread.join(15)
        sock.close()
