"""The processes below a process, for tests that check what a component left running or started; and
threads that cannot start, for tests of what a process does under a pids limit."""

from __future__ import annotations

import subprocess
import threading
from pathlib import Path

import pytest


def refuse_thread_starts(monkeypatch: pytest.MonkeyPatch, prefix: str) -> None:
    """From now until ``monkeypatch`` is undone, starting a thread whose name begins with ``prefix`` raises
    the RuntimeError CPython raises when the OS refuses a thread (a pids limit, no address space)."""
    started = threading.Thread.start

    def start(thread: threading.Thread) -> None:
        if thread.name.startswith(prefix):
            raise RuntimeError("can't start new thread")
        started(thread)
    monkeypatch.setattr(threading.Thread, "start", start)


def descendants(pid: int) -> set[int]:
    out = subprocess.run(["ps", "-eo", "pid=,ppid="], capture_output=True, text=True).stdout.split()
    pairs = [(int(a), int(b)) for a, b in zip(out[::2], out[1::2])]
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        nxt = {p for p, parent in pairs if parent in frontier} - found
        found |= nxt
        frontier = nxt
    return found


def command_line(pid: int) -> str:
    """The process's command line, arguments joined by spaces; "" once it is gone."""
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""
