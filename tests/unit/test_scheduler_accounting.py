"""What the scheduler counts when a request that already streamed moves workers and then finds no decode
room: its client saw a 200 and tokens, so it is no admission refusal and its queue stage is long over. The
dispatch and the route selection are stand-ins; what is checked is the scheduler's own accounting."""

from __future__ import annotations

from collections.abc import Iterator
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


def _rejections() -> float:
    return metrics.ADMISSION_REJECTIONS.labels(metrics.MODEL.value, "queue_timeout")._value.get()


def test_a_moved_request_that_finds_no_room_is_not_an_admission_refusal() -> None:
    selector = _Selector()
    scheduler = sch.Scheduler.__new__(sch.Scheduler)  # the parts generate() uses, without Redis or workers
    scheduler.model, scheduler.colocated, scheduler.journal = mock.Mock(), False, None
    scheduler.dispatcher = mock.Mock()  # never called: Attempt.open is the stand-in
    scheduler.view, scheduler.health = mock.Mock(), mock.Mock()
    scheduler.settings = SchedulerSettings(queue_timeout_s=0.2)
    scheduler.admission, scheduler.selector = sch.Admission(8), selector  # type: ignore[assignment]

    def open_attempt(*args: object, **kwargs: object) -> _Attempt:
        selector.opened += 1
        return _Attempt()

    before = _rejections()
    got = []
    with mock.patch.object(sch.Attempt, "open", staticmethod(open_attempt)), \
            mock.patch.object(sch, "Progress") as progress:
        progress.return_value.accept.side_effect = lambda chunk: chunk
        progress.return_value.finished = False
        with pytest.raises(Overloaded):
            for chunk in scheduler.generate(WorkerRequest("r1", [1, 2, 3], SamplingParams(max_tokens=8))):
                got.append(chunk)
    assert len(got) == 1  # it had streamed a token when its worker was lost
    assert _rejections() == before
    assert scheduler.admission.waiting == 0  # and it holds no place in the queue
