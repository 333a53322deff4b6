"""A request's cancellation: set once, from any thread, when its client is gone.

The ingress sets it when the client leaves while the request waits: for its first chunk (admission, waiting
for decode room, prefill), or for a later one (a preempted request waiting for KV blocks, a request moving to
another replica). A client that leaves then would otherwise hold its place in the queue or its blocks, and
its prefill would run to the end, for nobody. Whoever waits on the request's behalf looks at it: the
scheduler's back-off waits on it, and the dispatcher registers the cancel of the worker call it is blocked in
(``on_cancel``), so the wait ends at once and the request is aborted on its workers. A client that leaves
while tokens flow is also seen when the ingress closes the request's iterator (the scheduler's
``GeneratorExit`` path).
"""

from __future__ import annotations

import itertools
import logging
import threading
from collections.abc import Callable

log = logging.getLogger(__name__)


class ClientGone(Exception):
    """What a cancelled request's wait ends with: its client left (the API's 499)."""


class Cancellation:
    def __init__(self) -> None:
        self._event = threading.Event()
        self._lock = threading.Lock()
        self._callbacks: dict[int, Callable[[], object]] = {}
        self._ids = itertools.count()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def wait(self, timeout_s: float) -> bool:
        """Sleep up to ``timeout_s``; True (at once) when the request is or becomes cancelled."""
        return self._event.wait(timeout_s)

    def cancel(self) -> None:
        """Cancel the request: every registered callback runs once, here. Idempotent."""
        with self._lock:
            if self._event.is_set():
                return
            self._event.set()
            callbacks, self._callbacks = list(self._callbacks.values()), {}
        for callback in callbacks:
            _run(callback)

    def on_cancel(self, callback: Callable[[], object]) -> Callable[[], None]:
        """Run ``callback`` when the request is cancelled (at once, here, if it already is); returns the
        function that unregisters it."""
        with self._lock:
            if not self._event.is_set():
                key = next(self._ids)
                self._callbacks[key] = callback

                def remove() -> None:
                    with self._lock:
                        self._callbacks.pop(key, None)
                return remove
        _run(callback)
        return lambda: None


def _run(callback: Callable[[], object]) -> None:
    try:
        callback()
    except Exception:  # one failing cancel must not keep the others from running
        log.exception("a cancellation callback failed")
