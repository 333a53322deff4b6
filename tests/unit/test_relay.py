"""The relay between a backend's blocking iterator and the event loop, cancelled mid-wait."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Iterator

import pytest

from controlplane.api.relay import Relay, ThreadLanes
from controlplane.backend import Chunk
from controlplane.dispatch import WorkerRequest
from workers.runtime.sampler import SamplingParams

pytestmark = [pytest.mark.unit]


class BlockingBackend:
    """Yields one chunk, then blocks in next() until released; records whether its finally ran."""

    def __init__(self) -> None:
        self.waiting = threading.Event()
        self.release = threading.Event()
        self.closed = threading.Event()

    def generate(self, request: WorkerRequest) -> Iterator[Chunk]:
        try:
            yield Chunk((1,), "a", False, None, 3, 1)
            self.waiting.set()
            self.release.wait(10)
            yield Chunk((2,), "b", False, None, 3, 2)
            yield Chunk((3,), "c", True, "length", 3, 3)
        finally:
            self.closed.set()  # where the scheduler aborts the request on the workers


def test_a_task_cancelled_while_a_thread_waits_for_a_chunk_still_closes_the_backend() -> None:
    """At shutdown uvicorn cancels streaming tasks; the thread in next() must not be raced by close()
    ('generator already executing' skipped the abort and logged a traceback per stream)."""
    backend = BlockingBackend()
    relay = Relay(backend, WorkerRequest("r", [1, 2, 3], SamplingParams(max_tokens=3)), ThreadLanes(4))  # type: ignore[arg-type]  # a backend double

    async def consume() -> list[Chunk]:
        return [c async for c in relay.chunks()]

    async def main() -> BaseException | None:
        task = asyncio.create_task(consume())
        await asyncio.to_thread(backend.waiting.wait, 10)
        task.cancel()
        try:
            await task
        except BaseException as exc:  # noqa: BLE001 - what the cancelled task ended with is the point
            return exc
        return None

    ended_with = asyncio.run(main())
    assert isinstance(ended_with, asyncio.CancelledError), repr(ended_with)
    assert not backend.closed.is_set()  # the step is still inside next(): closing now would race it
    backend.release.set()
    assert backend.closed.wait(10), "the backend's generator was never closed"
