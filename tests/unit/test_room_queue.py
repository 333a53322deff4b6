"""The scheduler's wait for decode room: who may try for room, and who is woken when one leaves."""

from __future__ import annotations

import threading
import time

import pytest

from controlplane.cancellation import Cancellation
from controlplane.scheduler.room_queue import RoomQueue

pytestmark = [pytest.mark.unit]


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _joined(q: RoomQueue, rid: str, admitted: float) -> None:
    q.wait(rid, admitted, 0.0, Cancellation())  # joins; a zero wait returns at once


def test_nothing_is_held_until_one_has_waited_fcfs_after_s_then_its_replicas_for_later_requests():
    clock = Clock()
    q = RoomQueue(1.0, clock)
    assert q.held_from("new", 12.0) == frozenset()  # nobody waits
    _joined(q, "long", admitted=10.0)
    q.refused("long", frozenset({"d-1", "d-2"}))  # both replicas it can use refused it
    clock.now += 0.5
    _joined(q, "short", admitted=11.0)
    q.refused("short", frozenset({"d-2"}))
    assert q.first() is None  # nobody has waited a second: every request tries everywhere
    assert q.held_from("short", 11.0) == q.held_from("new", 12.0) == frozenset()
    clock.now += 0.5
    assert q.first() == "long"
    assert q.held_from("long", 10.0) == frozenset()  # it tries everywhere
    # admitted after it: kept off the replicas it waits to drain; a replica it cannot use (d-3) is not held
    assert q.held_from("short", 11.0) == q.held_from("new", 12.0) == {"d-1", "d-2"}
    assert q.held_from("moved", 5.0) == frozenset()  # admitted before it (a moved request): not held
    assert q.first_waited_s() == pytest.approx(1.0)  # what epd:scheduler_fcfs_hold_seconds shows
    q.leave("long")
    assert q.first() is None and q.held_from("new", 12.0) == frozenset()  # "short" has waited only 0.5 s
    assert q.first_waited_s() == 0.0
    clock.now += 0.5
    assert q.first() == "short" and q.held_from("new", 12.0) == {"d-2"}
    q.leave("short")
    q.leave("short")  # idempotent
    q.refused("short", frozenset({"d-1"}))  # not waiting: nothing recorded
    assert len(q) == 0 and q.first() is None


def test_the_earliest_admitted_goes_first_not_the_one_that_waited_longest():
    clock = Clock()
    q = RoomQueue(0.0, clock)  # 0: strictly first come, first served
    _joined(q, "later", admitted=20.0)
    clock.now += 3
    _joined(q, "earlier", admitted=10.0)
    q.refused("earlier", frozenset({"d-1"}))
    assert q.first() == "earlier" and q.held_from("later", 20.0) == {"d-1"}


def test_leaving_wakes_the_one_that_goes_next_at_once_and_no_other():
    q = RoomQueue(0.0)
    _joined(q, "a", admitted=1.0)
    _joined(q, "b", admitted=2.0)
    _joined(q, "c", admitted=3.0)
    woke: dict[str, float] = {}

    def waiter(rid: str, admitted: float) -> None:
        started = time.monotonic()
        q.wait(rid, admitted, 5.0, Cancellation())
        woke[rid] = time.monotonic() - started

    threads = [threading.Thread(target=waiter, args=(rid, a)) for rid, a in (("b", 2.0), ("c", 3.0))]
    for t in threads:
        t.start()
    time.sleep(0.1)
    q.leave("a")
    threads[0].join(2)
    assert "b" in woke and woke["b"] < 1.0  # woken, not its 5 s back-off
    time.sleep(0.2)
    assert "c" not in woke  # not its turn: left to sleep
    q.leave("b")
    threads[1].join(2)
    assert woke["c"] < 1.0


def test_a_cancelled_request_stops_waiting_at_once():
    q = RoomQueue(0.0)
    cancel = Cancellation()
    threading.Timer(0.1, cancel.cancel).start()
    started = time.monotonic()
    q.wait("gone", 1.0, 5.0, cancel)
    assert time.monotonic() - started < 2.0
    q.leave("gone")
    assert len(q) == 0


def test_the_hold_is_exported_as_a_gauge():
    from controlplane.observability import metrics

    clock = Clock()
    q = RoomQueue(1.0, clock)
    metrics.bind_cluster(None, held_for=q.first_waited_s)
    try:
        series = f'epd:scheduler_fcfs_hold_seconds{{model_name="{metrics.MODEL.value}"}}'
        assert f"{series} 0.0" in metrics.exposition().decode()
        _joined(q, "long", admitted=10.0)
        clock.now += 2.5
        assert f"{series} 2.5" in metrics.exposition().decode()
    finally:
        metrics.bind_cluster(None)
