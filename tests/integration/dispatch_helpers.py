"""What the worker-service tests share: running one request through the real Dispatcher, running many
at once on threads, and test images."""

from __future__ import annotations

import io
import threading
from collections.abc import Callable
from typing import TypeVar

from PIL import Image

from controlplane.dispatch import Dispatcher, Route, WorkerRequest


def run_request(dispatcher: Dispatcher, route: Route, req: WorkerRequest):
    """(every token id, the whole text, the last chunk) of one request."""
    tokens, text, last = [], "", None
    for chunk in dispatcher.run(req, route):
        tokens.extend(chunk.token_ids)
        text += chunk.text
        last = chunk
    return tokens, text, last


T = TypeVar("T")


def on_threads(fn: Callable[[int], T], n: int, timeout_s: float = 120) -> tuple[list[T | None], list[BaseException]]:
    """``fn(0) .. fn(n-1)`` at once, each on its own thread: (results in order, None where it raised; the
    errors raised)."""
    out: list[T | None] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            out[i] = fn(i)
        except BaseException as exc:  # noqa: BLE001 - returned to the test
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout_s)
    return out, errors


def png(color: tuple[int, int, int], size: tuple[int, int] = (48, 36)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()
