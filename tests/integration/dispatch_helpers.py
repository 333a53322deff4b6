"""What the worker-service tests share: running one request through the real Dispatcher, and test images."""

from __future__ import annotations

import io

from PIL import Image

from controlplane.dispatch import Dispatcher, Route, WorkerRequest


def run_request(dispatcher: Dispatcher, route: Route, req: WorkerRequest):  # type: ignore[no-untyped-def]
    """(every token id, the whole text, the last chunk) of one request."""
    tokens, text, last = [], "", None
    for chunk in dispatcher.run(req, route):
        tokens.extend(chunk.token_ids)
        text += chunk.text
        last = chunk
    return tokens, text, last


def png(color: tuple[int, int, int], size: tuple[int, int] = (48, 36)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "PNG")
    return buf.getvalue()
