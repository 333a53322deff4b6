"""A worker gives its free heap memory back once quiet (``workers.quiet_trim``): only after quiet_s of (almost)
no CPU, only once per stretch of work, never while busy; and glibc's malloc_trim really returns memory."""

from __future__ import annotations

import ctypes
import ctypes.util
import re

import pytest

from kvtransfer.memory import release_free_heap, retain_freed_buffers
from workers.quiet_trim import QuietTrim

pytestmark = [pytest.mark.unit]


class Process:
    """A fake clock and CPU-time counter a test moves by hand."""

    def __init__(self) -> None:
        self.now = 0.0
        self.cpu = 0.0
        self.trimmed: list[float] = []

    def trim(self) -> bool:
        self.trimmed.append(self.now)
        return True

    def run(self, trimmer: QuietTrim, seconds: float, busy: float, step: float = 5.0) -> None:
        """``seconds`` of wall time in ``step``s, using ``busy`` of a core, checking after each step."""
        for _ in range(round(seconds / step)):
            self.now += step
            self.cpu += busy * step
            trimmer.check()


def make(p: Process, **kw: float) -> QuietTrim:
    return QuietTrim(trim=p.trim, cpu_s=lambda: p.cpu, clock=lambda: p.now, **kw)


def test_a_burst_then_quiet_trims_once_after_quiet_s():
    p = Process()
    t = make(p, quiet_s=30, busy_fraction=0.02, min_work_s=5)
    p.run(t, 60, busy=1.0)  # a burst: 60 s at a full core
    assert p.trimmed == []
    p.run(t, 25, busy=0.001)  # quiet, but not for 30 s yet
    assert p.trimmed == []
    p.run(t, 10, busy=0.001)
    assert p.trimmed == [90.0]  # 30 s after the burst ended
    p.run(t, 600, busy=0.001)  # staying idle: no second trim
    assert p.trimmed == [90.0] and t.trims == 1
    p.run(t, 20, busy=1.0)  # the next burst, then quiet again: one more
    p.run(t, 40, busy=0.0)
    assert p.trimmed == [90.0, 95.0 + 600 + 20 + 30]  # the first trim's step ran to 95


def test_steady_light_load_above_the_busy_fraction_is_never_interrupted():
    p = Process()
    t = make(p, quiet_s=30, busy_fraction=0.02, min_work_s=5)
    p.run(t, 600, busy=0.05)  # 5% of a core throughout: 30 CPU seconds of work, never quiet
    assert p.trimmed == []


def test_an_idle_replicas_own_threads_never_add_up_to_work():
    """An idle worker still uses about 1% of a core (its engine loop's wake-ups, Ray's threads, the lease's
    heartbeat): below the quiet level, that is no work, so an hour idle after a trim brings no second one."""
    p = Process()
    t = make(p, quiet_s=30, busy_fraction=0.02, min_work_s=5)
    p.run(t, 20, busy=1.0)
    p.run(t, 3600, busy=0.01)
    assert len(p.trimmed) == 1


def test_little_work_since_the_last_trim_is_not_worth_another():
    p = Process()
    t = make(p, quiet_s=30, busy_fraction=0.02, min_work_s=5)
    p.run(t, 60, busy=0.01)  # quiet from the start, 0.6 CPU seconds of work: not worth a trim
    assert p.trimmed == []
    p.run(t, 10, busy=1.0)  # 10 s of work, then quiet
    p.run(t, 30, busy=0.0)
    assert p.trimmed == [100.0]


def test_a_failing_trim_is_logged_and_the_trimmer_goes_on(caplog):
    p = Process()

    def broken() -> bool:
        p.trimmed.append(p.now)
        raise OSError("no")
    t = QuietTrim(quiet_s=30, trim=broken, cpu_s=lambda: p.cpu, clock=lambda: p.now)
    p.run(t, 10, busy=1.0)
    p.run(t, 35, busy=0.0)
    assert p.trimmed == [40.0] and "giving free memory back" in caplog.text


@pytest.mark.parametrize("kw", [{"quiet_s": 0}, {"busy_fraction": 0}, {"busy_fraction": 1}, {"min_work_s": -1}])
def test_bad_settings_are_refused_by_name(kw):
    with pytest.raises(ValueError, match="quiet_s must be > 0"):
        QuietTrim(**kw)


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


@pytest.mark.skipif(not ctypes.util.find_library("c"), reason="glibc's malloc_trim")
def test_release_free_heap_returns_freed_heap_memory_to_the_kernel():
    """With the retention thresholds on (what every worker runs), 128 MiB of freed 1 MiB blocks stay resident
    until the trim: each lies between two live blocks, so only a trim inside the heap frees them."""
    retain_freed_buffers()
    libc = ctypes.CDLL(ctypes.util.find_library("c"))
    libc.malloc.restype = ctypes.c_void_p
    libc.malloc.argtypes = (ctypes.c_size_t,)
    libc.free.argtypes = (ctypes.c_void_p,)
    freed: list[int] = []
    kept: list[int] = []
    for _ in range(128):  # alternate: each freed block lies between two live ones, so none can merge into the top
        for blocks in (freed, kept):
            blocks.append(libc.malloc(2**20))
            ctypes.memset(blocks[-1], 1, 2**20)  # touched: resident
    for b in freed:
        libc.free(b)
    before = _rss_bytes()
    assert release_free_heap()
    after = _rss_bytes()
    for b in kept:
        libc.free(b)
    assert before - after > 96 * 2**20, (before, after)  # most of the 128 MiB freed


QUIET_PROCESS = r"""
import ctypes, ctypes.util, logging, sys, time
logging.basicConfig(level=logging.INFO, format="%(message)s")
from kvtransfer.memory import retain_freed_buffers
from workers.quiet_trim import QuietTrim

def rss_mib():
    return int(open("/proc/self/statm").read().split()[1]) * 4096 / 2**20

retain_freed_buffers()
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
trim = QuietTrim(quiet_s=1.0, min_work_s=0.5).start(every_s=0.1)
freed, kept = [], []
for _ in range(128):
    for blocks in (freed, kept):
        blocks.append(libc.malloc(2**20))
        ctypes.memset(blocks[-1], 1, 2**20)
for b in freed:
    libc.free(b)
end = time.process_time() + 1.0
while time.process_time() < end:  # a second of CPU work: then quiet
    pass
busy_rss = rss_mib()
time.sleep(3.0)
print(busy_rss, rss_mib(), trim.trims)
"""


@pytest.mark.skipif(not ctypes.util.find_library("c"), reason="glibc's malloc_trim")
def test_a_process_that_goes_quiet_gives_its_freed_heap_back_by_itself(tmp_path):
    """The real thread, the process's real CPU clock and glibc: 128 MiB freed inside the heap is given back
    within seconds of the process going quiet, once."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", QUIET_PROCESS], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    busy, quiet, trims = out.stdout.split()
    assert int(trims) == 1 and float(busy) - float(quiet) > 96, out.stdout
    given = re.search(r"quiet for 1 s: gave (\d+) MiB of free heap back to the kernel", out.stderr)
    assert given and int(given.group(1)) > 96, out.stderr  # what an operator reads in the replica's log
