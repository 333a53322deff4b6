"""Answers as server-sent events (their shapes: ``shapes``), and the client watched while it waits.

A stream is ``data: {json}\\n\\n`` events then ``data: [DONE]\\n\\n``. Chat: a first chunk with
``delta: {"role": "assistant", "content": ""}``, one chunk per text delta (and per token that brings no text
when it carries logprobs), a chunk with an empty delta and the ``finish_reason``, and
(``stream_options.include_usage``) a last chunk with empty ``choices`` and the ``usage``; with include_usage
every other chunk carries ``"usage": null``. Text completions: the same without the role chunk (with
``echo``, the prompt's text comes first instead). An error after the first byte is sent as one
``data: {"error": {...}}`` event (the status line is gone), then ``[DONE]``. While no token comes (a
preempted request waiting for KV blocks, a request moving to another replica), a comment line
``: keepalive\\n\\n`` goes out every ``EventStream.keepalive_s`` so proxies do not close the stream as idle;
SSE clients ignore comments.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from contextlib import aclosing, asynccontextmanager

import anyio
import anyio.to_thread
from pydantic import BaseModel
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from controlplane.api.errors import as_api_error
from controlplane.api.shapes import Shape, Whole, usage_of
from controlplane.backend import BackendError, Chunk, Overloaded
from controlplane.cancellation import Cancellation, ClientGone
from workers.runtime.errors import InvalidRequestError

log = logging.getLogger(__name__)
_EXPECTED = (Overloaded, BackendError, InvalidRequestError, ClientGone)
KEEPALIVE = ": keepalive\n\n"  # an SSE comment: bytes on the wire that every SSE parser skips


def _opening(shape: Shape, first: Chunk, include_usage: bool) -> str | None:
    opening = shape.opening(first)
    return None if opening is None else _event(opening, include_usage)


def _event(body: BaseModel, include_usage: bool) -> str:
    # OpenAI sends "usage": null on every chunk only when usage was asked for
    return f"data: {body.model_dump_json(exclude=None if include_usage else {'usage'})}\n\n"


async def sse_events(first: Chunk, rest: AsyncGenerator[Chunk, None], shape: Shape,
                     include_usage: bool) -> AsyncGenerator[str, None]:
    """The events of one answer; ``first`` was already taken from ``rest`` (admission passed)."""
    async with aclosing(rest):
        try:
            if first.prompt_logprobs:  # an echoed prompt's logprobs: a token's text per id, off the loop
                opened = await anyio.to_thread.run_sync(_opening, shape, first, include_usage)
            else:
                opened = _opening(shape, first, include_usage)
            if opened is not None:
                yield opened
            last = first
            if first.text or first.logprobs:
                yield _event(shape.delta(first), include_usage)
            async for chunk in rest:  # ends after the finished chunk (which may be ``first``)
                last = chunk
                if chunk.text or chunk.logprobs:
                    yield _event(shape.delta(chunk), include_usage)
            yield _event(shape.closing(last.finish_reason or "stop"), include_usage)
            if include_usage:
                yield _event(shape.usage(usage_of(last)), True)
        except Exception as exc:  # the status line is sent; report in-band, as OpenAI does
            if not isinstance(exc, _EXPECTED):
                log.exception("stream failed after it started")
            yield f"data: {as_api_error(exc).body().model_dump_json()}\n\n"
    yield "data: [DONE]\n\n"


@asynccontextmanager
async def client_watched(receive: Receive, cancel: Cancellation) -> AsyncIterator[None]:
    """While inside, a client that leaves cancels the request (``cancel``): a wait for its chunks (admission,
    waiting for decode room, prefill, a preempted decode: seconds) ends in ClientGone, and the workers abort
    it. The request's body was read already, so the next ASGI message is the disconnect. (A plain asyncio
    task: an anyio task group would cost each request about ten times as much.)"""
    async def watch_client() -> None:
        try:
            while (await receive())["type"] != "http.disconnect":
                pass
        except Exception:  # the server's receive failed: nothing to watch
            return
        await anyio.to_thread.run_sync(cancel.cancel)  # its callbacks cancel gRPC calls: off the loop

    watcher = asyncio.create_task(watch_client())
    _WATCHERS.add(watcher)  # the loop holds tasks weakly: kept until done, cancellation included
    watcher.add_done_callback(_WATCHERS.discard)
    try:
        yield
    finally:
        watcher.cancel()


_WATCHERS: set[asyncio.Task[None]] = set()


async def collect(first: Chunk, rest: AsyncGenerator[Chunk, None]) -> Whole:
    """The whole answer (run it ``client_watched``: a client that leaves then ends it in ClientGone)."""
    parts, last, ids, logprobs = [first.text], first, list(first.token_ids), list(first.logprobs)
    async with aclosing(rest):
        async for chunk in rest:
            parts.append(chunk.text)
            ids.extend(chunk.token_ids)
            logprobs.extend(chunk.logprobs)
            last = chunk
    return Whole("".join(parts), last, tuple(ids), tuple(logprobs), first.prompt_logprobs)


class EventStream(StreamingResponse):
    """SSE that notices a client leaving even while it waits for the next token, and always closes its event
    generator (and so the backend's iterator) on the way out.

    ``keepalive_s``: after each such silence on the wire, a ``KEEPALIVE`` comment goes out (0: never).
    ``on_leave``: called (on a thread) when the client is gone before the last event: the request's cancel, so
    the workers abort it at once, even while its next token is a minute away (a chunk being awaited cannot be
    interrupted otherwise)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncGenerator[str, None], keepalive_s: float = 0.0,
                 on_leave: Callable[[], object] | None = None) -> None:
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._events = events
        self._keepalive_s = keepalive_s
        self._on_leave = on_leave
        self._sending = asyncio.Lock()  # the events and the keepalives share one send
        self._sent_at = time.monotonic()
        self._closed = False  # the final body message is sent (or being sent): no keepalive after it

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        done = False
        try:
            async with anyio.create_task_group() as tg:
                async def stream() -> None:
                    nonlocal done
                    try:
                        await self._send_events(send)
                        done = True
                    except OSError:
                        pass  # the client went away mid-send
                    tg.cancel_scope.cancel()

                tg.start_soon(stream)
                if self._keepalive_s > 0:
                    tg.start_soon(self._keep_alive, send)
                await self.listen_for_disconnect(receive)
                if not done:  # first: the stream may wait for a chunk, and the task group for it
                    await self._leave()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                if not done:
                    await self._leave()
                await self._events.aclose()

    async def _send_events(self, send: Send) -> None:
        async with self._sending:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            self._sent_at = time.monotonic()
        async for event in self._events:
            async with self._sending:
                await send({"type": "http.response.body", "body": event.encode(), "more_body": True})
                self._sent_at = time.monotonic()
        async with self._sending:
            self._closed = True
            await send({"type": "http.response.body", "body": b"", "more_body": False})

    async def _keep_alive(self, send: Send) -> None:
        """A keepalive after each ``keepalive_s`` with nothing sent, until the final message; a send that fails
        (the client is gone) cancels the request and ends this task quietly (the stream notices on its own)."""
        while True:
            quiet = time.monotonic() - self._sent_at
            if quiet < self._keepalive_s:
                await anyio.sleep(self._keepalive_s - quiet)
                continue
            async with self._sending:
                if self._closed:
                    return
                if time.monotonic() - self._sent_at < self._keepalive_s:  # an event went out while this waited
                    continue
                try:
                    await send({"type": "http.response.body", "body": KEEPALIVE.encode(), "more_body": True})
                except Exception:  # the client is gone (OSError; uvloop's RuntimeError on a closed transport)
                    with anyio.CancelScope(shield=True):
                        await self._leave()
                    return
                self._sent_at = time.monotonic()

    async def _leave(self) -> None:
        if self._on_leave is not None:
            await anyio.to_thread.run_sync(self._on_leave)  # a request's cancel cancels gRPC calls: off the loop
