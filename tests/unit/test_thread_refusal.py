"""When the process cannot start a thread (a pids limit, no address space), the KV path's thread users
refuse the one piece of work that needed it and carry on: no task left queued to run later for a caller
that was told it failed, and a bulk listener that keeps accepting once threads can start again."""

from __future__ import annotations

import socket
import threading
import time

import pytest

from kvtransfer.bulk_listener import BulkListener
from kvtransfer.reused_threads import ReusedThreads

from proc_helpers import refuse_thread_starts

pytestmark = pytest.mark.unit


def test_a_task_whose_thread_could_not_start_never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = ReusedThreads("test-reused")
    ran: list[str] = []
    refuse_thread_starts(monkeypatch, "test-reused")
    with pytest.raises(RuntimeError, match="can't start new thread"):
        threads.submit(lambda: ran.append("refused"))
    monkeypatch.undo()
    done = threading.Event()

    def later() -> None:
        ran.append("later")
        done.set()
    threads.submit(later)
    assert done.wait(5)
    time.sleep(0.05)
    assert ran == ["later"]  # the refused task was not left queued for this thread to pick up


def test_a_bulk_listener_refuses_a_connection_it_has_no_thread_for_and_keeps_accepting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    listener = BulkListener("127.0.0.1", lambda conn: None, hello_timeout_s=0.3)
    try:
        refuse_thread_starts(monkeypatch, "kv-bulk-conn")
        refused = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        assert refused.recv(1) == b""  # closed at once
        refused.close()
        monkeypatch.undo()
        served = socket.create_connection(("127.0.0.1", listener.port), timeout=5)
        start = time.monotonic()
        assert served.recv(1) == b""  # its connection thread ran: silent, it hangs up at the hello timeout
        assert 0.2 < time.monotonic() - start < 3
        served.close()
    finally:
        monkeypatch.undo()
        listener.close()


def test_an_idle_thread_keeps_nothing_of_its_last_task() -> None:
    """What a finished task held (a stream, views into a shared-memory segment) is freed once it ends, not
    when the thread takes its next task: an idle reader kept a removed segment mapped."""
    import gc
    import weakref

    class Held:
        pass

    threads = ReusedThreads("test-reused-idle")
    held = Held()
    gone = weakref.ref(held)
    done = threading.Event()

    def task(obj: Held = held) -> None:
        done.set()
    threads.submit(task)
    del task, held
    assert done.wait(5)
    deadline = time.monotonic() + 5
    while gone() is not None and time.monotonic() < deadline:
        gc.collect()
        time.sleep(0.02)
    assert gone() is None, "the idle thread still holds its last task"
