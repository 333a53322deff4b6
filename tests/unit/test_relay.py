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


class RoomBackend:
    """Requests named wait-* block in their first step (waiting for decode room) until ``room`` is set; others
    stream three chunks at once."""

    def __init__(self) -> None:
        self.room = threading.Event()
        self.waiting = threading.Semaphore(0)

    def generate(self, request: WorkerRequest) -> Iterator[Chunk]:
        if request.request_id.startswith("wait"):
            self.waiting.release()
            self.room.wait(10)
        for i in range(3):
            yield Chunk((i,), str(i), i == 2, "length" if i == 2 else None, 3, i + 1)


def test_requests_waiting_for_room_do_not_starve_the_streams_already_flowing() -> None:
    """Each lane has 2 threads. A running stream's first chunk is out; then two requests wait for room,
    holding both threads of the first lane. The running stream still fetches its other chunks (the
    streaming lane), instead of waiting for room to free up for someone else."""
    backend = RoomBackend()
    lanes = ThreadLanes(2)

    def relay(rid: str) -> Relay:
        return Relay(backend, WorkerRequest(rid, [1, 2, 3], SamplingParams(max_tokens=3)), lanes)  # type: ignore[arg-type]  # a backend double

    async def main() -> list[int]:
        running = relay("run").chunks()
        first = await anext(running)
        waiters = [asyncio.create_task(_drain(relay(f"wait-{i}"))) for i in range(2)]
        for _ in range(2):
            await asyncio.to_thread(backend.waiting.acquire, True, 10)  # both hold a first-lane thread
        rest = await asyncio.wait_for(_drain_from(running), timeout=5)  # not behind the waiters
        backend.room.set()
        for w in waiters:
            assert len(await w) == 3
        return [*first.token_ids, *rest]

    assert asyncio.run(main()) == [0, 1, 2]


async def _drain(relay: Relay) -> list[int]:
    return [t async for c in relay.chunks() for t in c.token_ids]


async def _drain_from(chunks) -> list[int]:  # noqa: ANN001  # an async generator of Chunk
    return [t async for c in chunks for t in c.token_ids]


def test_a_request_that_finds_every_first_lane_thread_busy_past_the_wait_is_refused_as_overloaded() -> None:
    """Past ``first_wait_s`` with every first-lane thread admitting or waiting for room, a request is refused
    (429) instead of waiting in the event loop without a bound, uncounted by the queue. A request that gets a
    thread in time runs, and the thread is given back."""
    from controlplane.backend import Overloaded

    backend = RoomBackend()
    lanes = ThreadLanes(1, first_wait_s=0.3)

    def relay(rid: str) -> Relay:
        return Relay(backend, WorkerRequest(rid, [1, 2, 3], SamplingParams(max_tokens=3)), lanes)  # type: ignore[arg-type]  # a backend double

    async def main() -> tuple[BaseException | None, list[int], list[int]]:
        waiter = asyncio.create_task(_drain(relay("wait-0")))  # holds the only first-lane thread
        await asyncio.to_thread(backend.waiting.acquire, True, 10)
        refused: BaseException | None = None
        try:
            await asyncio.wait_for(_drain(relay("late")), timeout=5)  # unbounded, it would wait for the room
        except (Overloaded, TimeoutError) as exc:
            refused = exc
        backend.room.set()
        served = await waiter
        after = await _drain(relay("after"))  # the token came back
        return refused, served, after

    refused, served, after = asyncio.run(main())
    assert isinstance(refused, Overloaded) and "all 1 request threads are busy" in str(refused)
    assert served == [0, 1, 2] and after == [0, 1, 2]
