"""What the scheduler counts as waiting: a request leaves the queue once its workers hold it (not at its first
token, after prefill), also when it moved workers and then finds no decode room. Whether that end is an
admission refusal is the ingress's call (a 429, or an error in a stream that had its 200: tests/unit/test_api.py).
The dispatch and the route selection are stand-ins; what is checked is the scheduler's own accounting."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from unittest import mock

import grpc
import pytest

from controlplane.backend import Overloaded
from controlplane.dispatch import DispatchError, WorkerRequest
from controlplane.observability import metrics
from controlplane.scheduler import scheduler as sch
from controlplane.scheduler.policies import Candidate
from controlplane.scheduler.selection import Selection
from controlplane.settings import SchedulerSettings
from epd.worker.v1 import worker_pb2 as wpb
from workers.runtime.sampler import SamplingParams

pytestmark = [pytest.mark.unit]


def _candidate(name: str) -> Candidate:
    return Candidate(name, f"{name}:1", 0, 100, 100, 0)


SELECTION = Selection(_candidate("d"), _candidate("p"))


class _Attempt:
    """One token, then its decode worker is lost."""

    selection = SELECTION

    def __enter__(self) -> _Attempt:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def chunks(self) -> Iterator[wpb.TokenChunk]:
        yield wpb.TokenChunk(token_ids=[5], text="x", completion_tokens=1)
        raise DispatchError("decode", grpc.StatusCode.UNAVAILABLE, "worker died", ("d:1",))


class _Selector:
    """Routes the first attempt; after the loss every decode replica is full."""

    def __init__(self) -> None:
        self.opened = 0

    def select(self, request: WorkerRequest, refused: set[str], lost: set[str]) -> Selection | None:
        return SELECTION if self.opened == 0 else None

    def candidates(self, pool: str) -> list[Candidate]:
        return [_candidate("d2")]


def test_a_moved_request_that_finds_no_room_ends_overloaded_and_leaves_the_queue() -> None:
    selector = _Selector()
    scheduler = sch.Scheduler.__new__(sch.Scheduler)  # the parts generate() uses, without Redis or workers
    scheduler.model, scheduler.colocated, scheduler.journal = mock.Mock(), False, None
    scheduler.dispatcher = mock.Mock()  # never called: Attempt.open is the stand-in
    scheduler.view, scheduler.health = mock.Mock(), mock.Mock()
    scheduler.settings = SchedulerSettings(queue_timeout_s=0.2)
    scheduler.admission, scheduler.selector = sch.Admission(8), selector  # type: ignore[assignment]
    scheduler.room = sch.RoomQueue(scheduler.settings.fcfs_after_s)

    def open_attempt(*args: object, **kwargs: object) -> _Attempt:
        selector.opened += 1
        return _Attempt()

    rejections = metrics.ADMISSION_REJECTIONS.labels(metrics.MODEL.value, "queue_timeout")
    before = rejections._value.get()
    got = []
    with mock.patch.object(sch.Attempt, "open", staticmethod(open_attempt)), \
            mock.patch.object(sch, "Progress") as progress:
        tokens: list[int] = []  # the real Progress's: what the client has had

        def accept(chunk: wpb.TokenChunk) -> wpb.TokenChunk:
            tokens.extend(chunk.token_ids)
            return chunk
        request = WorkerRequest("r1", [1, 2, 3], SamplingParams(max_tokens=8))
        progress.return_value.accept.side_effect = accept
        progress.return_value.token_ids = tokens
        progress.return_value.finished = False
        progress.return_value.continuation.return_value = request  # the move's request: its cancel is unset
        with pytest.raises(Overloaded) as refused:
            for chunk in scheduler.generate(request):
                got.append(chunk)
    assert len(got) == 1  # it had streamed a token when its worker was lost
    assert refused.value.reason == "queue_timeout"  # the label the ingress counts it under, if it answers 429
    assert rejections._value.get() == before  # ...and only the ingress: counting here too would count it twice
    assert scheduler.admission.waiting == 0  # and it holds no place in the queue


class _PrefillingDispatcher:
    """Reserves (tells ``on_started``), then holds the first token until ``release`` is set, as a long
    prefill does."""

    def __init__(self) -> None:
        self.reserved = threading.Event()
        self.release = threading.Event()

    def run(self, req: WorkerRequest, route: object,
            on_started: Callable[[], None] = lambda: None) -> Iterator[wpb.TokenChunk]:
        on_started()
        self.reserved.set()
        assert self.release.wait(10)
        yield wpb.TokenChunk(token_ids=[5], text="x", finished=True, finish_reason="stop", completion_tokens=1)


def test_a_request_in_prefill_is_no_longer_waiting() -> None:
    """The queue ticket was given back with the first token, which comes after prefill: a request being
    prefilled counted in epd:num_requests_waiting and held one of scheduler.queue_size's places."""
    dispatcher = _PrefillingDispatcher()
    scheduler = sch.Scheduler.__new__(sch.Scheduler)
    scheduler.model, scheduler.colocated, scheduler.journal = mock.Mock(), False, None
    scheduler.view, scheduler.health, scheduler.dispatcher = mock.Mock(), mock.Mock(), dispatcher  # type: ignore[assignment]
    scheduler.settings = SchedulerSettings(queue_timeout_s=5)
    scheduler.admission, scheduler.selector = sch.Admission(8), _Selector()  # type: ignore[assignment]
    scheduler.room = sch.RoomQueue(scheduler.settings.fcfs_after_s)
    with mock.patch.object(sch, "Progress") as progress:
        progress.return_value.accept.side_effect = lambda chunk: chunk
        progress.return_value.finished = True
        request = WorkerRequest("r2", [1, 2, 3], SamplingParams(max_tokens=8))
        progress.return_value.continuation.return_value = request
        worker = threading.Thread(target=lambda: list(scheduler.generate(request)))
        worker.start()
        try:
            assert dispatcher.reserved.wait(10)
            assert scheduler.waiting == 0  # reserved on its decode worker, prefilling: not waiting
        finally:
            dispatcher.release.set()
            worker.join(10)
    assert not worker.is_alive()


class _BusyOnceDispatcher:
    """The first attempt reserves, then its prefill worker is busy (the request backs off and routes again);
    the second notes how many requests wait as it starts, then answers."""

    def __init__(self, scheduler: sch.Scheduler) -> None:
        self.scheduler = scheduler
        self.runs = 0
        self.waiting_at_retry: int | None = None

    def run(self, req: WorkerRequest, route: object,
            on_started: Callable[[], None] = lambda: None) -> Iterator[wpb.TokenChunk]:
        self.runs += 1
        if self.runs == 1:
            on_started()
            raise DispatchError("prefill", grpc.StatusCode.ALREADY_EXISTS, "a request with this id is running", ())
        self.waiting_at_retry = self.scheduler.waiting
        on_started()
        yield wpb.TokenChunk(token_ids=[5], text="x", finished=True, finish_reason="stop", completion_tokens=1)


def test_an_attempt_that_fails_after_reserving_puts_the_request_back_in_the_queue() -> None:
    """Taken out of the queue at its reservation, a request whose attempt then fails before its first token
    waits again: it counts as waiting and holds its place in queue_size while it backs off."""
    scheduler = sch.Scheduler.__new__(sch.Scheduler)
    dispatcher = _BusyOnceDispatcher(scheduler)

    class Always(_Selector):
        def select(self, request: WorkerRequest, refused: set[str], lost: set[str]) -> Selection | None:
            return SELECTION

    scheduler.model, scheduler.colocated, scheduler.journal = mock.Mock(), False, None
    scheduler.view, scheduler.health, scheduler.dispatcher = mock.Mock(), mock.Mock(), dispatcher  # type: ignore[assignment]
    scheduler.settings = SchedulerSettings(queue_timeout_s=5)
    scheduler.admission, scheduler.selector = sch.Admission(8), Always()  # type: ignore[assignment]
    scheduler.room = sch.RoomQueue(scheduler.settings.fcfs_after_s)
    with mock.patch.object(sch, "Progress") as progress:
        request = WorkerRequest("r3", [1, 2, 3], SamplingParams(max_tokens=8))
        progress.return_value.continuation.return_value = request
        progress.return_value.accept.side_effect = lambda chunk: chunk
        progress.return_value.token_ids = []
        progress.return_value.finished = True
        assert len(list(scheduler.generate(request))) == 1
    assert dispatcher.runs == 2 and dispatcher.waiting_at_retry == 1
    assert scheduler.waiting == 0


def test_a_stalled_worker_is_passed_over_by_the_moved_request_but_not_marked_suspect() -> None:
    """A worker whose stream sent only keepalives for max_stall_s is alive, just full: the request moves off
    it, and routing keeps sending other requests there."""
    scheduler = sch.Scheduler.__new__(sch.Scheduler)
    scheduler.health, scheduler.journal = mock.Mock(), None
    scheduler.settings = SchedulerSettings()
    error = DispatchError("decode", grpc.StatusCode.UNAVAILABLE, "keepalives but no token", stalled=("d:1",))
    lost: set[str] = set()
    progress = mock.Mock(token_ids=[1, 2])
    scheduler._moved("r", sch._Lost(error, SELECTION), progress, lost, 0)
    assert lost == {"d"}  # this request does not go back there
    scheduler.health.failure.assert_not_called()
    gone = DispatchError("decode", grpc.StatusCode.UNAVAILABLE, "sent nothing", lost=("d:1",))
    scheduler._moved("r", sch._Lost(gone, SELECTION), progress, set(), 1)
    scheduler.health.failure.assert_called_once()  # a lost worker is suspect, as before


def test_the_stall_bound_is_set_only_when_another_decode_replica_could_take_the_request() -> None:
    """With nowhere to move (one decode replica, the default), a preempted request waits on its worker
    rather than being moved off it into a 503."""
    scheduler = sch.Scheduler.__new__(sch.Scheduler)
    scheduler.settings, scheduler.colocated = SchedulerSettings(max_stall_s=30), False
    scheduler.health = mock.Mock()
    scheduler.health.routable.return_value = True

    class Two(_Selector):
        def candidates(self, pool: str) -> list[Candidate]:
            return [_candidate("d"), _candidate("d2")]

    scheduler.selector = Two()  # type: ignore[assignment]
    request = WorkerRequest("r", [1, 2, 3], SamplingParams(max_tokens=8))
    assert request.max_stall_s == math.inf  # unbounded unless the scheduler says otherwise
    assert scheduler._with_stall_bound(request, SELECTION, set()).max_stall_s == 30
    assert scheduler._with_stall_bound(request, SELECTION, {"d2"}).max_stall_s == math.inf  # the other is lost
    one_token = WorkerRequest("r1", [1, 2, 3], SamplingParams(max_tokens=1))
    assert scheduler._with_stall_bound(one_token, SELECTION, set()).max_stall_s == math.inf  # nothing streams


def test_a_stall_bound_under_the_idle_limit_is_refused() -> None:
    with pytest.raises(ValueError, match=r"max_stall_s \(2\) must be at least token_idle_timeout_s \(5\)"):
        SchedulerSettings(max_stall_s=2)
