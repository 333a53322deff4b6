"""First come, first served for requests that wait for decode room, once one has waited long enough.

Requests that no decode replica can take now wait, each retrying on its own back-off. That alone is work
conserving but not fair: under steady load a long prompt, which needs many free blocks at once, loses
every race to shorter requests that arrive after it and fit in what is free, until it times out with 429.

So each waiting request joins this queue, and once the oldest of them (by admission) has waited
``fcfs_after_s``, it goes first: no request admitted after it tries for room until it is placed or leaves
(cancelled, timed out). The running requests then drain until it fits, as in vLLM's and SGLang's FCFS
queues. When it leaves, the next in line (if it has waited as long) is woken at once, so it tries without
waiting out its back-off. Below ``fcfs_after_s`` every waiting request tries on its own, as before: a short
wait costs no one anything. One queue per scheduler (control plane process); requests of another process
are not seen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.cancellation import Cancellation


@dataclass
class _Waiter:
    admitted: float  # its admission time: the queue's order
    since: float  # when it began to wait for room
    wake: threading.Event = field(default_factory=threading.Event)


class RoomQueue:
    def __init__(self, fcfs_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.fcfs_after_s = fcfs_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiter] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def first(self) -> str | None:
        """The request that goes first now: the earliest admitted of those that waited ``fcfs_after_s``."""
        with self._lock:
            return self._first()

    def _first(self) -> str | None:
        now = self.clock()
        due = [(w.admitted, rid) for rid, w in self._waiting.items() if now - w.since >= self.fcfs_after_s]
        return min(due)[1] if due else None

    def may_try(self, rid: str, admitted: float) -> bool:
        """Whether the request (admitted at ``admitted``) may try for room now: no request admitted before
        it has waited past ``fcfs_after_s`` (or it is that request)."""
        with self._lock:
            first = self._first()
            return first is None or first == rid or admitted < self._waiting[first].admitted

    def wait(self, rid: str, admitted: float, timeout_s: float, cancel: Cancellation) -> None:
        """Join the queue (if not in it yet) and sleep up to ``timeout_s``; woken at once when this one goes
        first after another left, or is cancelled."""
        with self._lock:
            waiter = self._waiting.get(rid)
            if waiter is None:
                waiter = self._waiting[rid] = _Waiter(admitted, self.clock())
        forget = cancel.on_cancel(waiter.wake.set)
        try:  # a wake-up set since this request last looked (it goes first now) ends the wait at once
            waiter.wake.wait(timeout_s)
        finally:
            waiter.wake.clear()
            forget()

    def leave(self, rid: str) -> None:
        """The request no longer waits (placed, cancelled, timed out, failed); the one that goes first now,
        if any, is woken to try at once (only it: the others could not try anyway, and waking every waiter
        would send a burst of doomed reservations). Idempotent."""
        with self._lock:
            if self._waiting.pop(rid, None) is None:
                return
            first = self._first()
            wake = self._waiting[first].wake if first is not None else None
        if wake is not None:
            wake.set()
