"""RayProbe's verdict over time: Ray answering, failing, hanging and coming back. Pure logic: the round trip
through Ray is a stand-in and the clock is the test's (tests/integration/test_ray_loss.py kills a real head)."""

from __future__ import annotations

import threading
import time

import pytest

from controlplane.pools.ray_probe import RayProbe


class _Ray:
    """The probe's round trip: answers, raises ``error``, or blocks while ``hang`` is set."""

    def __init__(self) -> None:
        self.error: Exception | None = None
        self.hang = threading.Event()
        self.released = threading.Event()
        self.calls = 0

    def round_trip(self) -> None:
        self.calls += 1
        if self.hang.is_set():
            self.released.wait(10)
        if self.error is not None:
            raise self.error


@pytest.fixture
def fake() -> _Ray:
    return _Ray()


def _after_calls(fake: _Ray, n: int) -> None:
    target = fake.calls + n
    deadline = time.monotonic() + 5
    while fake.calls < target:
        assert time.monotonic() < deadline, "the probe stopped calling Ray"
        time.sleep(0.005)


def test_lost_only_after_the_limit_without_an_answer_and_well_again_once_ray_answers(fake: _Ray, caplog) -> None:
    now = [100.0]
    probe = RayProbe("the Ray cluster at ray://head:10001", every_s=0.001, lost_after_s=60, clock=lambda: now[0],
                     round_trip=fake.round_trip)
    probe.start()
    try:
        _after_calls(fake, 2)
        now[0] += 120
        _after_calls(fake, 2)  # answered meanwhile: the clock moved, yet a round trip finished since
        assert probe.lost() is None
        fake.error = ConnectionError("Failed to serialize\n   response!")
        _after_calls(fake, 2)
        now[0] += 59
        assert probe.lost() is None  # 59 s without an answer: not yet
        now[0] += 2
        reason = probe.lost()
        assert reason is not None and reason.startswith("the Ray cluster at ray://head:10001 has not answered for 61 s")
        assert "(Failed to serialize response!)" in reason  # the last error, on one line
        assert probe.lost() == reason and len([r for r in caplog.records if r.levelname == "ERROR"]) == 1
        fake.error = None
        _after_calls(fake, 2)
        assert probe.lost() is None
    finally:
        probe.close()


def test_a_round_trip_that_hangs_counts_as_no_answer(fake: _Ray) -> None:
    now = [0.0]
    probe = RayProbe("the local Ray", every_s=0.001, lost_after_s=60, clock=lambda: now[0], round_trip=fake.round_trip)
    fake.hang.set()
    probe.start()
    try:
        deadline = time.monotonic() + 5
        while fake.calls < 1:  # then blocked in ray.get
            assert time.monotonic() < deadline, "the probe never called Ray"
            time.sleep(0.005)
        now[0] += 61
        reason = probe.lost()
        assert reason is not None and reason.startswith("the local Ray has not answered for 61 s (a round trip "
                                                        "has not returned)")
    finally:
        fake.released.set()
        probe.close()
