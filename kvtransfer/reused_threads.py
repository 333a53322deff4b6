"""Daemon threads reused from task to task, a new one started only when every one is busy.

For work that lives as long as one stream and may block for all of it (reading a stream's frames,
writing a stream's chunks): a bounded pool could leave a stream waiting for a thread while the one
it waits on holds the thread, so this never makes a task wait. Starting a thread per stream is a
visible share of a small push's time; a reused one is woken, not started. Daemon, so a task cut off
mid-read never holds up the process's exit.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable


class ReusedThreads:
    def __init__(self, name: str) -> None:
        self.name = name
        self._tasks: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = 0
        self._lock = threading.Lock()

    def submit(self, fn: Callable[[], None]) -> None:
        """Run ``fn`` now on an idle thread, or a new one. ``fn`` reports its own failures: an
        exception it lets out is dropped. When a new thread cannot start (RuntimeError, e.g. a pids
        limit), that error is raised here and ``fn`` never runs."""
        with self._lock:
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1
        if spawn:  # the new thread takes fn itself: a thread that fails to start leaves no task behind
            # in a box it empties: a Thread keeps its args until its target returns, here for good
            threading.Thread(target=self._run, args=([fn],), name=self.name, daemon=True).start()
        else:
            self._tasks.put(fn)

    def _run(self, box: list[Callable[[], None]]) -> None:
        fn: Callable[[], None] | None = box.pop()
        while fn is not None:
            try:
                fn()
            except BaseException:  # noqa: BLE001 - see submit
                pass
            # an idle thread must not keep its last task alive (and what that holds: a stream, its session,
            # views into a shared-memory segment, which then stays mapped after the sender removed it)
            fn = None
            with self._lock:
                self._idle += 1
            fn = self._tasks.get()
