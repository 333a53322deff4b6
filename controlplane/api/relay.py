"""Relays a backend's blocking chunk iterator to the event loop without ever blocking the loop.

  1. The first ``next()`` (which calls ``backend.generate``) runs on a worker thread; Overloaded
     and BackendError raised there reach the handler before any byte is sent.
  2. Each later chunk is one more thread hop. After a finished chunk the same hop drains the
     iterator (it must end there), so the backend's bookkeeping after its last yield runs and a
     1-token request costs two hops, not three.
  3. Leaving early (client gone, task cancelled, error) closes the backend's iterator on a thread,
     shielded from the cancellation, so its ``finally`` aborts the request on the workers. If a thread
     is still inside ``next()`` (the task was cancelled while waiting for a chunk, as at shutdown), the
     close is left to that thread for when its ``next()`` returns: closing a generator that is running
     raises "generator already executing" and would skip the abort.
"""

from __future__ import annotations

import asyncio
import math
import threading
import weakref
from collections.abc import AsyncGenerator, Callable, Generator, Iterator
from dataclasses import dataclass

import anyio
import anyio.to_thread

from controlplane.backend import Backend, BackendError, Chunk, Overloaded
from controlplane.dispatch import WorkerRequest

_END = object()


class ThreadLanes:
    """Capacity limiters per event loop for the threads that wait on backend chunks, in two lanes.

    Apart from anyio's default 40 threads. A request's first step (admission, then waiting for decode
    room: seconds) takes a thread of the ``first`` lane; every later step (a flowing stream's next chunk,
    the close) one of the ``streaming`` lane. In one lane, a burst of requests waiting for room held every
    thread, the running streams could not fetch their tokens, and their workers looked hung.

    ``first_wait_s``: how long a request may wait for a first-lane thread (all of them busy admitting or
    waiting for room) before it is refused as overloaded (429); None waits without bound. One set of
    limiters per loop, as a limiter is bound to the loop that first waits on it."""

    def __init__(self, threads: int, first_wait_s: float | None = None) -> None:
        self.threads = threads
        self.first_wait_s = first_wait_s
        self._by_loop: weakref.WeakKeyDictionary[object, tuple[anyio.CapacityLimiter, ...]] = \
            weakref.WeakKeyDictionary()

    def streaming(self) -> anyio.CapacityLimiter:
        """The running loop's streaming lane (``threads`` threads)."""
        return self._lanes()[1]

    def _lanes(self) -> tuple[anyio.CapacityLimiter, ...]:
        """(the first lane, the streaming lane, an unbounded one) of the running loop."""
        loop = asyncio.get_running_loop()
        lanes = self._by_loop.get(loop)
        if lanes is None:
            lanes = self._by_loop[loop] = (anyio.CapacityLimiter(self.threads), anyio.CapacityLimiter(self.threads),
                                           anyio.CapacityLimiter(math.inf))
        return lanes

    async def first_step(self, step: Callable[[], tuple[object, bool]]) -> tuple[object, bool]:
        """Run a request's first step on a thread of the first lane, waiting at most ``first_wait_s`` for one."""
        first, _, unbounded = self._lanes()
        if self.first_wait_s is None:
            return await anyio.to_thread.run_sync(step, limiter=first)
        with anyio.move_on_after(self.first_wait_s) as waited:
            await first.acquire()
        if waited.cancelled_caught:  # no token came in time (a cancelled acquire holds none)
            raise Overloaded(f"all {self.threads} request threads are busy admitting requests or waiting for decode "
                             f"room; retry later", max(1.0, self.first_wait_s), reason="relay_busy")
        try:  # the thread itself is counted by the token just taken
            return await anyio.to_thread.run_sync(step, limiter=unbounded)
        finally:
            first.release()


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


class _Stepper:
    """Steps an iterator on worker threads and closes it once, never while a step runs."""

    def __init__(self, it: Generator[Chunk, None, None]) -> None:
        self.it = it
        self._lock = threading.Lock()
        self._running = False
        self._close_pending = False

    def step(self) -> tuple[object, bool]:
        with self._lock:
            self._running = True
        try:
            return _step(self.it)
        finally:
            with self._lock:
                self._running = False
                close_now, self._close_pending = self._close_pending, False
            if close_now:
                self.it.close()

    def close(self) -> None:
        with self._lock:
            if self._running:  # the step's thread closes it as soon as its next() returns
                self._close_pending = True
                return
        self.it.close()


@dataclass
class Relay:
    """``async for chunk in Relay(...).chunks()``: the request's chunks, the last one finished."""

    backend: Backend
    request: WorkerRequest
    lanes: ThreadLanes

    async def chunks(self) -> AsyncGenerator[Chunk, None]:
        streaming = self.lanes.streaming()
        stepper = _Stepper(_drive(self.backend, self.request))
        ended = False
        first = True
        try:
            while True:
                if first:  # admission and waiting for room; the rest only fetch tokens
                    item, ended = await self.lanes.first_step(stepper.step)
                    first = False
                else:
                    item, ended = await anyio.to_thread.run_sync(stepper.step, limiter=streaming)
                if item is _END:
                    raise BackendError("the backend ended the request without finishing it", status=502)
                assert isinstance(item, Chunk)
                yield item
                if item.finished:
                    return
        finally:
            if not ended:
                with anyio.CancelScope(shield=True):
                    await anyio.to_thread.run_sync(stepper.close, limiter=streaming)
