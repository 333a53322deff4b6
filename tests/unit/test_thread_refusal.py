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

pytestmark = pytest.mark.unit


def _refuse_threads_named(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    started = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith(prefix):
            raise RuntimeError("can't start new thread")
        started(thread)
    monkeypatch.setattr(threading.Thread, "start", start)


def test_a_task_whose_thread_could_not_start_never_runs(monkeypatch: pytest.MonkeyPatch) -> None:
    threads = ReusedThreads("test-reused")
    ran: list[str] = []
    _refuse_threads_named(monkeypatch, "test-reused")
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
        _refuse_threads_named(monkeypatch, "kv-bulk-conn")
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
