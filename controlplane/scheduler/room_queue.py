"""First come, first served for requests that wait for decode room, once one has waited long enough.

Requests that no decode replica can take now wait, each retrying on its own back-off. That alone is work
conserving but not fair: under steady load a long prompt, which needs many free blocks at once, loses
every race to shorter requests that arrive after it and fit in what is free, until it times out with 429.

So each request that waits for room joins this queue, and once the earliest admitted of them has waited
``fcfs_after_s`` it goes first: requests admitted after it leave alone the decode replicas that last
refused it for room (it names them each round with ``refused``) until it is placed or leaves (cancelled,
timed out). Those replicas then drain until it fits, as a vLLM or SGLang engine's first-come-first-served
queue drains for its head; replicas it cannot use (too small for it, or lost by it) go on serving the
others. Which of its replicas will fit it first cannot be known ahead (running requests end when they
end), so all of them are held; usually that is the whole pool. When the first request leaves, the next in line
(if it has waited as long) is woken at once, so it tries without waiting out its back-off. Below
``fcfs_after_s`` nothing is held: a short wait costs no one anything. One queue per scheduler (control
plane process); requests of another process are not seen.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from controlplane.cancellation import Cancellation

FIRST_CACHE_S = 0.01  # who goes first is recomputed at most this often (and on every join and leave)


@dataclass
class _Waiter:
    admitted: float  # its admission time: the queue's order
    since: float  # when it began to wait for room
    wake: threading.Event = field(default_factory=threading.Event)
    refused_by: frozenset[str] = frozenset()  # the decode replicas that refused it for room, as it last said


class RoomQueue:
    def __init__(self, fcfs_after_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.fcfs_after_s = fcfs_after_s
        self.clock = clock
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiter] = {}
        self._first: tuple[float, str | None] = (-float("inf"), None)  # (computed at, request id)

    def __len__(self) -> int:
        return len(self._waiting)

    def first(self) -> str | None:
        """The request that goes first now: the earliest admitted of those that waited ``fcfs_after_s``."""
        with self._lock:
            return self._first_now()

    def _first_now(self) -> str | None:
        now = self.clock()
        at, rid = self._first
        if now - at <= FIRST_CACHE_S:
            return rid
        due = [(w.admitted, r) for r, w in self._waiting.items() if now - w.since >= self.fcfs_after_s]
        rid = min(due)[1] if due else None
        self._first = (now, rid)
        return rid

    def first_waited_s(self) -> float:
        """How long the request that goes first has waited for room; 0 when none does (nothing is held)."""
        if not self._waiting:
            return 0.0
        with self._lock:
            first = self._first_now()
            return self.clock() - self._waiting[first].since if first is not None else 0.0

    def held_from(self, rid: str, admitted: float) -> frozenset[str]:
        """The decode replicas the request (admitted at ``admitted``) must leave alone now: those that refused
        the request that goes first, when that one was admitted before it; else none."""
        if not self._waiting:  # the common case, without the lock: nobody waits for room
            return frozenset()
        with self._lock:
            first = self._first_now()
            if first is None or first == rid:
                return frozenset()
            head = self._waiting[first]
            return head.refused_by if head.admitted <= admitted else frozenset()

    def refused(self, rid: str, worker_ids: frozenset[str]) -> None:
        """The waiting request was refused for room by ``worker_ids`` this round (a request not waiting:
        nothing)."""
        waiter = self._waiting.get(rid)
        if waiter is not None:
            waiter.refused_by = worker_ids

    def wait(self, rid: str, admitted: float, timeout_s: float, cancel: Cancellation) -> None:
        """Join the queue (if not in it yet) and sleep up to ``timeout_s``; woken at once when this one goes
        first after another left, or is cancelled."""
        with self._lock:
            waiter = self._waiting.get(rid)
            if waiter is None:
                waiter = self._waiting[rid] = _Waiter(admitted, self.clock())
                self._first = (-float("inf"), None)
        forget = cancel.on_cancel(waiter.wake.set)
        try:  # a wake-up set since this request last looked (it goes first now) ends the wait at once
            waiter.wake.wait(timeout_s)
        finally:
            waiter.wake.clear()
            forget()

    def leave(self, rid: str) -> None:
        """The request no longer waits (placed, cancelled, timed out, failed); the one that goes first now,
        if any, is woken to try at once (only it: waking every waiter would send a burst of reservations
        doomed to be refused). Idempotent."""
        if rid not in self._waiting:
            return
        with self._lock:
            if self._waiting.pop(rid, None) is None:
                return
            self._first = (-float("inf"), None)
            first = self._first_now()
            wake = self._waiting[first].wake if first is not None else None
        if wake is not None:
            wake.set()
