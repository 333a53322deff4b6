"""Relays a backend's blocking chunk iterator to the event loop without ever blocking the loop.

  1. The first ``next()`` (which calls ``backend.generate``) runs on a worker thread; Overloaded
     and BackendError raised there reach the handler before any byte is sent.
  2. Each later chunk is one more thread hop. After a finished chunk the same hop drains the
     iterator (it must end there), so the backend's bookkeeping after its last yield runs and a
     1-token request costs two hops, not three.
  3. Leaving early (client gone, task cancelled, error) closes the backend's iterator on a thread,
     shielded from the cancellation, so its ``finally`` aborts the request on the workers.
"""

from __future__ import annotations

import asyncio
import weakref
from dataclasses import dataclass
from typing import AsyncGenerator, Generator, Iterator

import anyio
import anyio.to_thread

from controlplane.backend import Backend, BackendError, Chunk
from controlplane.dispatch import WorkerRequest

_END = object()


class ThreadLanes:
    """A capacity limiter per event loop for the threads that wait on backend chunks.

    Apart from anyio's default 40 threads: a request waiting for decode room (seconds) holds one,
    and must not starve requests whose tokens are already flowing. One per loop, as a limiter is
    bound to the loop that first waits on it."""

    def __init__(self, threads: int) -> None:
        self.threads = threads
        self._by_loop: weakref.WeakKeyDictionary[object, anyio.CapacityLimiter] = weakref.WeakKeyDictionary()

    def limiter(self) -> anyio.CapacityLimiter:
        loop = asyncio.get_running_loop()
        lim = self._by_loop.get(loop)
        if lim is None:
            lim = self._by_loop[loop] = anyio.CapacityLimiter(self.threads)
        return lim


def _drive(backend: Backend, request: WorkerRequest) -> Generator[Chunk, None, None]:
    # A generator of our own, so close() exists whatever iterator the backend returns, and
    # reaches the backend's generator through ``yield from``.
    yield from backend.generate(request)


def _step(it: Iterator[Chunk]) -> tuple[object, bool]:
    """The next chunk (or _END) and whether the iterator has ended."""
    try:
        item = next(it)
    except StopIteration:
        return _END, True
    if isinstance(item, Chunk) and item.finished:
        try:
            next(it)  # a chunk after the finished one breaks the contract; it is dropped
        except StopIteration:
            return item, True
    return item, False


@dataclass
class Relay:
    """``async for chunk in Relay(...).chunks()``: the request's chunks, the last one finished."""

    backend: Backend
    request: WorkerRequest
    lanes: ThreadLanes

    async def chunks(self) -> AsyncGenerator[Chunk, None]:
        limiter = self.lanes.limiter()
        it = _drive(self.backend, self.request)
        ended = False
        try:
            while True:
                item, ended = await anyio.to_thread.run_sync(_step, it, limiter=limiter)
                if item is _END:
                    raise BackendError("the backend ended the request without finishing it", status=502)
                assert isinstance(item, Chunk)
                yield item
                if item.finished:
                    return
        finally:
            if not ended:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(it.close, limiter=limiter)
