"""Run torch single-threaded on the transfer's own threads, without touching anyone else's.

The sender encodes several chunks at once on its encoder threads, and a receiver decodes each
stream on its handler thread. Left alone, every such thread that calls a torch op opens its own
OpenMP team of ``torch.get_num_threads()`` workers: a few encoder threads then run several times
as many compute threads as there are cores, whose idle workers spin between ops, so the same work
takes more CPU time than it does single-threaded.

``torch.set_num_threads`` cannot help: it also changes the process-wide default that every thread
created afterwards starts from (the engine's, say). OpenMP's thread count, however, is a per-thread
setting, so this sets it on the calling thread only, through the OpenMP runtime torch loaded,
after torch's own lazy per-thread initialisation (which would overwrite it) has run. Where that
runtime cannot be found (another OpenMP, or none), it does nothing: a speed-up only.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable
from typing import Any

import torch

_local = threading.local()
_omp_set_num_threads: Callable[..., Any] | None = None  # libgomp's omp_set_num_threads, once found
_looked_up = False
_lock = threading.Lock()


def single_threaded_torch() -> bool:
    """Make torch ops on the calling thread run on it alone; True if that took effect."""
    if getattr(_local, "done", False):
        return True
    setter = _find_setter()
    if setter is None:
        return False
    torch.get_num_threads()  # runs torch's lazy per-thread init first, or it would undo this later
    setter(1)
    _local.done = torch.get_num_threads() == 1
    return _local.done


def _find_setter() -> Callable[..., Any] | None:
    global _omp_set_num_threads, _looked_up
    with _lock:
        if not _looked_up:
            _looked_up = True
            _omp_set_num_threads = _load()
        return _omp_set_num_threads


def _load() -> Callable[..., Any] | None:
    if "OpenMP" not in torch.__config__.parallel_info():
        return None
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "omp" in line and ".so" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads  # the already-loaded library: same handle
        except (OSError, AttributeError):
            continue
        fn.argtypes = (ctypes.c_int,)
        fn.restype = None
        return fn
    return None
