"""controlplane.cancellation: a request's cancel runs each registered callback once, from the thread that
cancels; one registered after the cancel runs at once; an unregistered one never runs."""

from __future__ import annotations

import threading

import pytest

from controlplane.cancellation import Cancellation

pytestmark = [pytest.mark.unit]


def test_callbacks_run_once_each_and_unregistered_ones_not_at_all() -> None:
    cancel = Cancellation()
    ran: list[str] = []
    cancel.on_cancel(lambda: ran.append("a"))
    forget = cancel.on_cancel(lambda: ran.append("b"))
    cancel.on_cancel(lambda: ran.append("c"))
    forget()
    assert not cancel.cancelled and ran == []
    cancel.cancel()
    cancel.cancel()  # idempotent
    assert cancel.cancelled and sorted(ran) == ["a", "c"]
    forget()  # after the cancel: harmless
    late = cancel.on_cancel(lambda: ran.append("late"))  # already cancelled: runs here, at once
    assert ran[-1] == "late"
    late()


def test_a_failing_callback_does_not_keep_the_others_from_running(caplog: pytest.LogCaptureFixture) -> None:
    cancel = Cancellation()
    ran: list[int] = []
    cancel.on_cancel(lambda: 1 / 0)
    cancel.on_cancel(lambda: ran.append(1))
    cancel.cancel()
    assert ran == [1] and "a cancellation callback failed" in caplog.text


def test_wait_ends_when_another_thread_cancels() -> None:
    cancel = Cancellation()
    assert cancel.wait(0) is False
    started = threading.Event()
    woke: list[bool] = []

    def waiter() -> None:
        started.set()
        woke.append(cancel.wait(30))
    thread = threading.Thread(target=waiter)
    thread.start()
    started.wait(10)
    cancel.cancel()
    thread.join(10)
    assert woke == [True]
