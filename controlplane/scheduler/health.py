"""Which workers routing trusts: a circuit breaker per worker, with half-open probes.

  CLOSED     routed normally; ``failures`` consecutive failed calls (or one ``lost``: the stream broke,
             the worker went quiet) open it.
  OPEN       not routed for ``open_s`` seconds (the worker is *suspect*).
  HALF_OPEN  after that, one request at a time may try it (the probe). A success closes the breaker;
             a failure opens it again for another ``open_s``.
A worker the registry no longer lists is forgotten with ``forget``. Time comes from an injected clock.
``on_lost`` hears of each lost worker (the pool manager probes it at once and replaces it if it hangs).
"""

from __future__ import annotations

import enum
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass


class BreakerState(enum.Enum):
    CLOSED = "closed"
    OPEN = "open"
    HALF_OPEN = "half_open"


@dataclass
class _Breaker:
    failures: int = 0
    opened_at: float | None = None
    probing: bool = False  # a half-open probe is in flight
    reason: str = ""


@dataclass(frozen=True)
class Suspect:
    """A worker routing avoids now, and why (for /ready, logs and `epd status`)."""

    worker_id: str
    state: BreakerState
    reason: str


class WorkerHealth:
    def __init__(self, failures: int = 3, open_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 on_lost: Callable[[str], None] | None = None) -> None:
        self.failures = failures
        self.on_lost = on_lost
        self.open_s = open_s
        self.clock = clock
        self._breakers: dict[str, _Breaker] = {}
        self._lock = threading.Lock()

    def state(self, worker_id: str) -> BreakerState:
        with self._lock:
            return self._state(self._breakers.get(worker_id))

    def _state(self, b: _Breaker | None) -> BreakerState:
        if b is None or b.opened_at is None:
            return BreakerState.CLOSED
        return BreakerState.OPEN if self.clock() - b.opened_at < self.open_s else BreakerState.HALF_OPEN

    def routable(self, worker_id: str) -> bool:
        """Whether routing may pick the worker now (no lock: the common, healthy case is one dict read)."""
        b = self._breakers.get(worker_id)
        if b is None or b.opened_at is None:
            return True
        with self._lock:
            return self._state(b) is BreakerState.HALF_OPEN and not b.probing

    def begin(self, worker_id: str) -> None:
        """A request was sent to the worker; through a half-open breaker it is the one probe."""
        b = self._breakers.get(worker_id)
        if b is None or b.opened_at is None:
            return
        with self._lock:
            if self._state(b) is BreakerState.HALF_OPEN:
                b.probing = True

    def end(self, worker_id: str) -> None:
        """A request sent to the worker ended without a verdict on it (refused for room, the client gone):
        a half-open breaker lets the next probe through."""
        b = self._breakers.get(worker_id)
        if b is not None and b.probing:
            with self._lock:
                b.probing = False

    def success(self, worker_id: str) -> None:
        if worker_id not in self._breakers:
            return
        with self._lock:
            self._breakers.pop(worker_id, None)

    def failure(self, worker_id: str, reason: str, *, lost: bool = False) -> None:
        """A failed call; ``lost``: the worker died or hung mid-request, so it is suspect at once."""
        with self._lock:
            b = self._breakers.setdefault(worker_id, _Breaker())
            b.failures += 1
            b.reason = reason
            half_open = b.opened_at is not None and self._state(b) is BreakerState.HALF_OPEN
            if lost or half_open or b.failures >= self.failures:
                b.opened_at = self.clock()
                b.probing = False
        if lost and self.on_lost is not None:
            try:
                self.on_lost(worker_id)
            except Exception:  # a listener's trouble never fails the request that noticed the loss
                pass

    def forget(self, worker_id: str) -> None:
        with self._lock:
            self._breakers.pop(worker_id, None)

    def suspects(self) -> list[Suspect]:
        with self._lock:
            return [Suspect(w, self._state(b), b.reason) for w, b in sorted(self._breakers.items())
                    if b.opened_at is not None]
