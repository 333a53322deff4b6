"""Size limits on what a request may carry, and its body's encoding, checked before anything is decoded or sent
on; a large body's preparation moved off the event loop.

A request's images travel to an encode worker in one gRPC message of at most 64 MiB
(``kvtransfer.options.MAX_MESSAGE_BYTES``), so the ingress refuses, with a 4xx that says so:

  - an image over ``MAX_IMAGE_BYTES`` (20 MiB decoded, OpenAI's own limit per image): 400;
  - images over ``MAX_IMAGES_BYTES`` together (48 MiB decoded): 400;
  - a body over ``MAX_BODY_BYTES`` (80 MiB: 48 MiB of images in base64 is 64 MiB): 413, read no further;
  - a body in UTF-16 or UTF-32 (which Python's json would read): 400.

A body of ``OFF_LOOP_BYTES`` or more is parsed as JSON in a worker thread (``OffLoopJSONRoute``), and turned
into token ids there too (``prepare_off_loop``): a body of millions of token ids (about 0.6 s of ``json.loads``
for 10 million) would otherwise hold every other request on the event loop. The body's validation against its
model (about a quarter of the parse's time) still runs on the loop.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import TypeVar

import anyio.to_thread
from fastapi.routing import APIRoute
from starlette.requests import Request
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from controlplane.api.errors import APIError

MiB = 1 << 20
MAX_IMAGE_BYTES = 20 * MiB
MAX_IMAGES_BYTES = 48 * MiB
MAX_BODY_BYTES = 80 * MiB
OFF_LOOP_BYTES = 64 * 1024  # a body this large is turned into token ids in a worker thread

T = TypeVar("T")


async def prepare_off_loop(request: Request, prepare: Callable[[], T]) -> T:
    """``prepare()`` (a prompt tokenised, a chat template rendered, images or token ids decoded), in a worker
    thread when the body holds ``OFF_LOOP_BYTES`` or more (or does not say its length): a long prompt then
    stalls no other request on the event loop. A small one runs here, where a thread's hand-off would cost
    more."""
    length = request.headers.get("content-length", "")
    if length.isdigit() and int(length) < OFF_LOOP_BYTES:
        return prepare()
    return await anyio.to_thread.run_sync(prepare)


class OffLoopJSONRequest(Request):
    """A request whose JSON body is parsed in a worker thread when it holds ``OFF_LOOP_BYTES`` or more."""

    _parsed: object

    async def json(self) -> object:
        if not hasattr(self, "_parsed"):
            body = await self.body()
            self._parsed = (json.loads(body) if len(body) < OFF_LOOP_BYTES
                            else await anyio.to_thread.run_sync(json.loads, body))
        return self._parsed


class OffLoopJSONRoute(APIRoute):
    """A route whose handler reads its request as an ``OffLoopJSONRequest`` (FastAPI's custom route class):
    what FastAPI does with the parsed body, and a malformed body's error, are unchanged."""

    def get_route_handler(self) -> Callable:
        handler = super().get_route_handler()

        async def off_loop_handler(request: Request) -> Response:
            return await handler(OffLoopJSONRequest(request.scope, request.receive))
        return off_loop_handler


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"The request body is larger than this server accepts ({limit // MiB} MiB); images may "
                         f"be at most {MAX_IMAGE_BYTES // MiB} MiB each and {MAX_IMAGES_BYTES // MiB} MiB together.",
                    code="request_too_large")


def check_utf8_json(head: bytes) -> None:
    """A 400 unless a body starting with ``head`` (its first 4 bytes) is UTF-8 (with or without a BOM), the
    only encoding JSON allows between systems (RFC 8259). Python's json would also read UTF-16 and UTF-32."""
    encoding = json.detect_encoding(head) if head else "utf-8"
    if encoding not in ("utf-8", "utf-8-sig"):
        raise APIError(400, f"The request body is not UTF-8 (it reads as {encoding.upper()}); send JSON encoded "
                            f"as UTF-8.")


class BodyLimit:
    """Refuse a body over ``limit`` bytes: at once from its Content-Length, else (chunked) when the bytes
    read pass it. The second raises ``body_too_large`` from ``receive``, which the app's handlers answer."""

    def __init__(self, app: ASGIApp, limit: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.limit:
            await body_too_large(self.limit).response()(scope, receive, send)
            return
        seen = 0
        head = b""  # the body's first 4 bytes, which tell UTF-16 and UTF-32 from UTF-8

        async def counting_receive() -> Message:
            nonlocal seen, head
            message = await receive()
            if message["type"] == "http.request":
                body = message.get("body", b"")
                seen += len(body)
                if seen > self.limit:
                    raise body_too_large(self.limit)
                if len(head) < 4:
                    head += body[:4 - len(head)]
                    if len(head) == 4 or not message.get("more_body", False):
                        check_utf8_json(head)
            return message

        await self.app(scope, counting_receive, send)
