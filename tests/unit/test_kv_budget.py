"""The sender's byte budget: bounded, deadline-bound, and balanced even when a stream fails while waiting."""

from __future__ import annotations

import threading
import time

import grpc
import pytest

from kvtransfer.budget import ByteBudget
from kvtransfer.errors import TransferFailed


def test_waits_for_room_then_takes_it() -> None:
    budget = ByteBudget(100)
    never = threading.Event()
    budget.acquire(80, time.monotonic() + 5, never)
    got = threading.Event()

    def take() -> None:
        budget.acquire(50, time.monotonic() + 5, never)
        got.set()

    t = threading.Thread(target=take)
    t.start()
    assert not got.wait(0.2)  # 80 + 50 > 100: it waits
    budget.release(80)
    assert got.wait(2) and budget.used == 50
    t.join()


def test_an_item_larger_than_the_budget_passes_alone() -> None:
    budget = ByteBudget(10)
    budget.acquire(1000, time.monotonic() + 1, threading.Event())
    assert budget.used == 1000


def test_the_deadline_bounds_the_wait() -> None:
    budget = ByteBudget(10)
    budget.acquire(10, time.monotonic() + 1, threading.Event())
    with pytest.raises(TransferFailed) as err:
        budget.acquire(5, time.monotonic() + 0.1, threading.Event())
    assert err.value.code == grpc.StatusCode.DEADLINE_EXCEEDED and budget.used == 10


def test_a_failed_stream_leaves_the_count_balanced() -> None:
    budget = ByteBudget(10)
    budget.acquire(10, time.monotonic() + 1, threading.Event())
    failed = threading.Event()
    failed.set()
    budget.acquire(5, time.monotonic() + 5, failed)  # stops waiting at once; the caller releases next
    budget.release(5)
    budget.release(10)
    assert budget.used == 0
