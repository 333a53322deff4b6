"""Admission: the bounded queue of requests that wait for a route (stage 1 of a request's life).

At most ``queue_size`` requests wait at once; one more is refused at once (429). A ``Ticket`` stays in
the queue until its request is routed (``routed``) or ends; either way the count drops exactly once.
"""

from __future__ import annotations

import threading
from types import TracebackType

from controlplane.backend import Overloaded


class Ticket:
    """One admitted request's place in the queue; a context manager that gives it back on exit."""

    def __init__(self, admission: Admission) -> None:
        self._admission = admission
        self._held = True
        self._lock = threading.Lock()

    @property
    def queued(self) -> bool:
        return self._held

    def routed(self) -> bool:
        """Leave the queue (the request reached a worker); True the first time only."""
        with self._lock:
            held, self._held = self._held, False
        if held:
            self._admission._leave()
        return held

    def requeue(self) -> None:
        """Back into the queue after ``routed``: the attempt that took the request out failed before its
        first token, so the request waits again (already admitted: ``queue_size`` is not checked again)."""
        with self._lock:
            held, self._held = self._held, True
        if not held:
            self._admission._return()

    def __enter__(self) -> Ticket:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.routed()


class Admission:
    def __init__(self, queue_size: int) -> None:
        self.queue_size = queue_size
        self._waiting = 0
        self._lock = threading.Lock()

    @property
    def waiting(self) -> int:
        return self._waiting

    def admit(self) -> Ticket:
        """A ticket in the queue, or Overloaded (429) when ``queue_size`` requests already wait."""
        with self._lock:
            if self._waiting >= self.queue_size:
                waiting = "1 request is" if self._waiting == 1 else f"{self._waiting} requests are"
                raise Overloaded(f"{waiting} already waiting for decode room, the most this server queues "
                                 f"(scheduler.queue_size); retry later", 1.0, reason="queue_full")
            self._waiting += 1
        return Ticket(self)

    def _leave(self) -> None:
        with self._lock:
            self._waiting -= 1

    def _return(self) -> None:
        with self._lock:
            self._waiting += 1
