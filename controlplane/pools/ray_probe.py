"""Whether the Ray cluster the pools run on still answers.

A Ray head that restarts is a new cluster: the actors of the old one are gone, and a Ray client connection
to it cannot be resumed, so the pool manager's calls fail for good while the API keeps answering.

``RayProbe`` runs one thread that round-trips a tiny object through Ray (``ray.put`` then ``ray.get``) every
``every_s``. When no round trip has finished for ``lost_after_s`` (each failed, or one hung), ``lost()``
says so, with the last error; ``epd serve`` then answers ``/health`` with 503, so Kubernetes restarts the
control plane, which joins the cluster as it is now and starts the pools again. The thread's own calls are
independent of the reconcile loop, which may wait minutes for a replica to start.

This is for a cluster joined through the Ray client (``ray://``, the chart). A private Ray, or one joined by
its GCS address, takes the process with it instead: Ray ends the driver when its raylet dies, or once its
GCS has been gone for a minute.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import ray

log = logging.getLogger(__name__)

EVERY_S = 5.0
LOST_AFTER_S = 60.0  # longer than a Ray client's reconnect grace (30 s) and a busy object store's hiccup
CALL_TIMEOUT_S = 10.0


class RayProbe:
    def __init__(self, where: str, *, every_s: float = EVERY_S, lost_after_s: float = LOST_AFTER_S,
                 clock: Callable[[], float] = time.monotonic, round_trip: Callable[[], None] | None = None) -> None:
        """``where``: the cluster as an operator knows it ("the Ray cluster at ray://...", "the local Ray").
        ``round_trip``: one call through Ray that raises or hangs when it does not answer (default: a tiny
        object put and got back)."""
        self.where = where
        self._round_trip = round_trip or _put_and_get
        self.every_s = every_s
        self.lost_after_s = lost_after_s
        self._clock = clock
        self._ok_at = clock()
        self._error: str | None = None
        self._said = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> RayProbe:
        self._ok_at = self._clock()
        self._thread = threading.Thread(target=self._run, name="ray-probe", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop probing; a round trip hung in Ray is left to its daemon thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(1.0)
            self._thread = None

    def lost(self) -> str | None:
        """None while Ray answers; else why the control plane should be restarted."""
        silent = self._clock() - self._ok_at
        if silent < self.lost_after_s:
            return None
        error = self._error or "a round trip has not returned"
        reason = (f"{self.where} has not answered for {silent:.0f} s ({error}); the pools "
                  f"cannot be managed until the control plane restarts and joins it again")
        if not self._said:
            self._said = True
            log.error("%s", reason)
        return reason

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._round_trip()
            except Exception as exc:
                if self._stop.is_set():
                    return
                self._error = " ".join(str(exc).split())[:300] or type(exc).__name__
            else:
                self._ok_at, self._error, self._said = self._clock(), None, False
            self._stop.wait(self.every_s)


def _put_and_get() -> None:
    ray.get(ray.put(None), timeout=CALL_TIMEOUT_S)
