"""Keep freed multi-MiB buffers in the process instead of handing them back to the kernel.

Every gRPC message of a KV push is a fresh ``bytes`` object of a few MiB on both ends: the sender
frames each chunk into one, and grpcio hands the receiver's handler one per message. glibc serves
allocations that size with ``mmap`` (or trims them off the heap when freed), so each message paid
a page fault, and the kernel zeroing the page, per 4 KiB page on each side, in system time that grows
with the push. With the mmap
threshold at glibc's maximum (32 MiB) and a high trim threshold, a freed message stays in
malloc's free lists and the next message reuses its pages.

The cost is memory the process keeps mapped after a burst: up to the trim threshold of free space
at the top of each heap, plus whatever freed buffers fragmentation strands (bounded by the peak of
live buffers under 32 MiB, which the transfer budgets bound). Allocations of 32 MiB and more (model
weights, the paged cache) are unaffected. Where glibc's ``mallopt`` is unavailable this is a no-op.
``release_free_heap`` gives that memory back; a worker calls it once it has gone quiet
(``workers.quiet_trim``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # annotations only: the module imports torch lazily, where it is used
    import torch

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 32 * 2**20  # glibc's largest accepted value on 64-bit
TRIM_THRESHOLD_BYTES = 256 * 2**20

_lock = threading.Lock()
_done: bool | None = None


def retain_freed_buffers() -> bool:
    """Apply the settings above once per process; True when glibc accepted them."""
    global _done
    with _lock:
        if _done is None:
            _done = _apply()
        return _done


def _glibc(name: str) -> Any:
    """glibc's function ``name``, or None where the C library is not glibc (musl, macOS): nothing to tune."""
    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def _apply() -> bool:
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def release_free_heap() -> bool:
    """Hand the free pages of every malloc arena back to the kernel (glibc's ``malloc_trim(0)``, which also
    returns whole free pages inside a heap, not only at its top): what the thresholds above keep after a
    burst. It takes each arena's lock while it walks it, so call it when the process is quiet. True when
    memory was returned; False when none was, or where glibc is not the allocator."""
    trim = _glibc("malloc_trim")
    if trim is None:
        return False
    trim.argtypes = (ctypes.c_size_t,)
    trim.restype = ctypes.c_int
    return bool(trim(0))


class BufferPool:
    """Reusable byte buffers for encoded chunks on the sender, so a push writes into pages that are
    already mapped.

    Encoding a chunk into a fresh tensor costs page faults, and the kernel zeroing each page, whenever
    malloc hands back memory from a new mapping. It does that for the encoder threads' own arenas
    each time one of their heaps empties and is unmapped, so the kernel's page clearing and fault path
    show up in a profile of a large quantised push. ``take`` returns a free buffer of at
    least ``nbytes`` (and at most twice that, so a small chunk does not pin a big buffer) or a new one;
    ``give`` files it for the next chunk, keeping at most ``max_bytes`` of idle buffers (the rest are
    freed as before). Idle buffers stay allocated until ``clear``: the pool's size is the peak of
    chunks in flight at once (what the sender's budget allows), like malloc's retained heap above."""

    def __init__(self, max_bytes: int = 256 * 2**20) -> None:
        self.max_bytes = max_bytes
        self._free: list[torch.Tensor] = []  # torch.uint8 tensors, 1-D
        self._idle = 0
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            fits = [i for i, b in enumerate(self._free) if nbytes <= b.numel() <= 2 * nbytes]
            if fits:
                buf = self._free.pop(min(fits, key=lambda i: self._free[i].numel()))
                self._idle -= buf.numel()
                return buf
        return self._allocate(nbytes)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        """A new buffer of ``nbytes``, when no idle one fits."""
        import torch

        return torch.empty(nbytes, dtype=torch.uint8)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            if self._idle + buf.numel() <= self.max_bytes:
                self._free.append(buf)
                self._idle += buf.numel()

    @property
    def idle_bytes(self) -> int:
        with self._lock:
            return self._idle

    def clear(self) -> None:
        with self._lock:
            self._free.clear()
            self._idle = 0
