"""Hung-worker detection for the dispatcher's streaming calls, and the worker channels' keepalive.

A ``StreamWatch`` cancels a watched call that received nothing for longer than its current idle
limit (one limit until the first message, which covers queueing and prefill, another between
messages); the caller then sees the call cancelled and ``expired`` tells it why. One thread serves
every watched call, ticking every ``tick_s`` seconds.

``keepalive_options`` make a channel ping the worker every ``keepalive_s`` seconds while calls are in
flight and fail them (UNAVAILABLE) when a ping goes unanswered for as long again (and a connection
attempt that gets no HTTP/2 answer in twice that): a SIGSTOPped worker's
kernel still acknowledges TCP, so only an HTTP/2 ping reaches the stopped process. The worker's server
must accept pings that often (workers.service_base sets its side).
"""

from __future__ import annotations

import itertools
import math
import threading
import time
from collections.abc import Callable
from typing import Protocol


class Cancellable(Protocol):
    def cancel(self) -> bool: ...


def keepalive_options(keepalive_s: float) -> tuple[tuple[str, int], ...]:
    ms = max(1, round(keepalive_s * 1000))
    return (("grpc.keepalive_time_ms", ms), ("grpc.keepalive_timeout_ms", ms),
            ("grpc.keepalive_permit_without_calls", 0),
            ("grpc.http2.max_pings_without_data", 0),  # keep pinging while a call waits for its first byte
            ("grpc.http2.ping_timeout_ms", ms),  # the unanswered ping's own timer (default: a minute)
            # a (re)connect to a stopped process is accepted by its kernel but never answered: give up after
            # this long (grpc's default is 20 s), so a call on it fails over instead of waiting
            ("grpc.min_reconnect_backoff_ms", 2 * ms))


class Watched:
    """One watched call. ``touch`` after each message; ``expired`` says whether the watch cancelled it.

    The clock runs only while the caller waits for the worker: ``touch`` stops it (the caller holds a
    message) and ``resume`` starts it again when the caller asks for the next one. A caller slow to ask
    (its consumer busy, its threads starved under a burst) reads messages the channel already buffered,
    so its own pace never makes a worker look hung."""

    def __init__(self, call: Cancellable, first_s: float, idle_s: float, clock: Callable[[], float]) -> None:
        self.call = call
        self.idle_s = idle_s
        self.clock = clock
        self.deadline = clock() + first_s
        self.expired = False
        self.limit_s = first_s

    def touch(self) -> None:
        """A message arrived: the next limit is the idle one, and the clock stops until ``resume``."""
        self.limit_s = self.idle_s
        self.deadline = math.inf

    def resume(self) -> None:
        """The caller waits for the worker again: the current limit counts from now."""
        self.deadline = self.clock() + self.limit_s


class StreamWatch:
    def __init__(self, tick_s: float = 0.1, clock: Callable[[], float] = time.monotonic) -> None:
        self.tick_s = tick_s
        self.clock = clock
        self._calls: dict[int, Watched] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def watch(self, call: Cancellable, first_s: float, idle_s: float) -> tuple[int, Watched]:
        w = Watched(call, first_s, idle_s, self.clock)
        key = next(self._ids)
        with self._lock:
            self._calls[key] = w
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dispatch-watch", daemon=True)
                self._thread.start()
        return key, w

    def unwatch(self, key: int) -> None:
        with self._lock:
            self._calls.pop(key, None)

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(self.tick_s):
            now = self.clock()
            with self._lock:
                late = [(k, w) for k, w in self._calls.items() if w.deadline <= now]
                for k, _ in late:
                    del self._calls[k]
            for _, w in late:
                w.expired = True
                w.call.cancel()
