"""Pin a replica's process to CPU cores, so pools share a machine on equal, fixed terms.

``pool.cpu_affinity`` lists cores; replica ``i`` of the pool gets ``cores[i % len(cores)]``. Every
thread of the process is moved (Linux affinity is per thread, and torch, gRPC and Ray have already
started some), and threads started later inherit it. Used by ``epd bench compare`` to give each
worker one core in both modes.
"""

from __future__ import annotations

import os


def core_for(cores: list[int], index: int) -> int | None:
    return cores[index % len(cores)] if cores else None


def pin_process(core: int) -> None:
    """Move every thread of this process to ``core``. OSError names a core this machine lacks."""
    available = os.sched_getaffinity(0)
    if core not in available:
        raise OSError(f"cannot pin to CPU core {core}: this process may use cores {sorted(available)}")
    for tid in os.listdir("/proc/self/task"):
        try:
            os.sched_setaffinity(int(tid), {core})
        except (ProcessLookupError, PermissionError):  # a thread that just ended, or one we may not move
            pass
