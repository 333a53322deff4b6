"""Give a worker's free heap memory back to the kernel once the worker has gone quiet.

A worker keeps freed memory in malloc's arenas on purpose while it serves (``kvtransfer.memory``: no page
fault per message), and a busy engine's peak working set stays there too, so after a burst its resident
memory stays at the burst's high-water mark for good. That is memory a container's limit counts. Once the
process has been quiet for ``quiet_s`` (it used under ``busy_fraction`` of one core over that window) after
doing at least ``min_work_s`` of CPU work since the last trim (CPU time above ``busy_fraction``: what an idle
worker's own threads use never adds up to work), ``release_free_heap`` runs once: a quiet
worker gives its free memory back, a busy one is never interrupted, and one that stays idle is not trimmed
over and over.

Quiet is measured on the process's own CPU time, so nothing on the serving path has to report to it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable

from kvtransfer.memory import release_free_heap

log = logging.getLogger(__name__)

QUIET_S = 30.0
BUSY_FRACTION = 0.02  # of one core: heartbeats and gRPC keepalives stay well under it
MIN_WORK_S = 5.0  # CPU seconds of work since the last trim before another is worth it


def resident_bytes() -> int:
    """This process's resident memory (Linux), else 0."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def process_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class QuietTrim:
    """Runs ``trim`` when the process turns quiet (see the module's docstring). ``check`` is one look, for
    the thread (``start``) or a caller that drives it with its own clock."""

    def __init__(self, quiet_s: float = QUIET_S, busy_fraction: float = BUSY_FRACTION, min_work_s: float = MIN_WORK_S,
                 trim: Callable[[], bool] = release_free_heap, cpu_s: Callable[[], float] = process_cpu_s,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if quiet_s <= 0 or not 0 < busy_fraction < 1 or min_work_s < 0:
            raise ValueError(f"quiet_s must be > 0, busy_fraction in (0, 1) and min_work_s >= 0; got {quiet_s}, "
                             f"{busy_fraction} and {min_work_s}")
        self.quiet_s = quiet_s
        self.busy_fraction = busy_fraction
        self.min_work_s = min_work_s
        self._trim = trim
        self._cpu_s = cpu_s
        self._clock = clock
        self._samples = [(clock(), cpu_s())]  # (clock, cpu seconds): the last quiet_s of them, and one before
        self._work = 0.0  # CPU seconds above the quiet level since the last trim
        self.trims = 0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def check(self) -> bool:
        """Sample the process's CPU time; trim if it has been quiet for ``quiet_s`` after enough work. True
        when it trimmed."""
        now, cpu = self._clock(), self._cpu_s()
        if self._samples:
            then, cpu_then = self._samples[-1]
            self._work += max(0.0, (cpu - cpu_then) - self.busy_fraction * (now - then))
        self._samples.append((now, cpu))
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.quiet_s:
            self._samples.pop(0)  # keep one sample at least quiet_s old, if there is one
        then, cpu_then = self._samples[0]
        if now - then < self.quiet_s or cpu - cpu_then > self.busy_fraction * (now - then):
            return False  # not watched for long enough yet, or busy
        if self._work < self.min_work_s:
            return False  # quiet, but little has happened since the last trim
        started, before = self._clock(), resident_bytes()
        try:
            self._trim()
        except Exception:  # a trim that fails leaves the worker as it was
            log.exception("giving free memory back to the kernel failed")
        else:
            after = resident_bytes()
            if before and after:
                log.info("quiet for %.0f s: gave %.0f MiB of free heap back to the kernel in %.2f s (resident "
                         "%.0f -> %.0f MiB)", self.quiet_s, (before - after) / 2**20, self._clock() - started,
                         before / 2**20, after / 2**20)
        self._work = 0.0  # the trim's own work does not count as work to trim after
        self._samples = [(self._clock(), self._cpu_s())]
        self.trims += 1
        return True

    def start(self, every_s: float | None = None) -> QuietTrim:
        """Look every ``every_s`` (default a sixth of ``quiet_s``) on a daemon thread until ``stop``."""
        interval = self.quiet_s / 6 if every_s is None else every_s

        def run() -> None:
            while not self._stop.wait(interval):
                self.check()
        self._thread = threading.Thread(target=run, name="quiet-trim", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
