"""Shared-memory segments for the same-host path: the payload moves through a file in /dev/shm and
only control messages travel: on the receiver's bulk TCP connection when it has one (kvtransfer.bulk),
else on the gRPC Push stream.

The sender creates a segment (mode 0600, so only the same user can open it) and writes each
chunk's scales and payload at increasing offsets; the receiver maps it by name and reads chunks in
place. Segments are reused: a fresh tmpfs page costs a page fault on first touch, which would bound a
fresh-segment-per-stream design by the fault rate, so the sender keeps a small pool of segments
(``SegmentPool``) and the receiver keeps its mappings (``SegmentCache``), both populated up front
(MAP_POPULATE). The sender unlinks its segments when it closes; segments of a sender that died
are removed by ``reap_orphans`` (names carry the creator's pid), which a new sender runs at start and
every receiver's janitor every few seconds; a segment whose pid is not found is removed only if no
process holds the lock its creator takes before naming it (a live sender in another pid namespace that
shares /dev/shm keeps it). A same-user process that truncates a segment under the
receiver can crash it (SIGBUS); segments are private to the user running both. Names are checked
against a fixed pattern, so a handshake cannot point the receiver at any other file.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import re
import threading
import time
import uuid
from collections import OrderedDict
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^epd-kv-([0-9]+)-[0-9a-f]{32}$")
_MAP_FLAGS = mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0)


class ShmError(OSError):
    """A segment could not be created, opened, or read at the requested range. ``lasting`` (a segment the
    pool could not make): /dev/shm could not hold it even empty, so only a larger /dev/shm helps."""

    def __init__(self, message: str, lasting: bool = True) -> None:
        super().__init__(message)
        self.lasting = lasting


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class SharedSegment:
    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._fd = fd
        self._map = mmap.mmap(fd, size, flags=_MAP_FLAGS) if size else None
        self._view = memoryview(self._map) if self._map is not None else memoryview(bytearray())

    @classmethod
    def create(cls, size: int) -> SharedSegment:
        if not shm_available():
            raise ShmError(f"{SHM_DIR} is not available for shared memory")
        token = uuid.uuid4().hex
        name = f"epd-kv-{os.getpid()}-{token}"
        path, building = SHM_DIR / name, SHM_DIR / f"epd-kv-new-{token}"  # (the second name no reaper matches)
        try:
            fd = os.open(building, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise ShmError(f"cannot create shared memory {building}: {exc.strerror}") from None
        try:
            # Allocated now, not sparse: a tmpfs too small for it refuses here (ENOSPC), where a sparse file
            # would map fine and kill this process with SIGBUS at the first write past what /dev/shm holds.
            os.posix_fallocate(fd, 0, size)
            # Held until this process closes the segment or dies (the kernel drops it then), and taken before
            # the file gets its reapable name: a reaper that cannot see our pid (another pid namespace
            # sharing /dev/shm) still sees the segment is in use.
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            os.rename(building, path)
            return cls(name, fd, size, owner=True)
        except OSError as exc:
            os.close(fd)
            building.unlink(missing_ok=True)
            path.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise ShmError(f"{SHM_DIR} has no room for a {_size(size)} segment ({_room()}); give the "
                               "worker a larger /dev/shm (docker run --shm-size, the chart's shmSize)") from None
            raise ShmError(f"cannot set up shared memory {path} ({size} bytes): {exc.strerror}") from None

    @classmethod
    def attach(cls, name: str, size: int) -> SharedSegment:
        if not _NAME.match(name):
            raise ShmError(f"invalid shared-memory name {name!r}")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise ShmError(f"cannot open {path} ({exc.strerror}); sender and receiver may not share a host") from None
        actual = os.fstat(fd).st_size
        if actual < size:
            os.close(fd)
            raise ShmError(f"{path} holds {actual} bytes, the handshake announced {size}")
        return cls(name, fd, size, owner=False)

    def view(self, offset: int, length: int) -> memoryview:
        if offset < 0 or length < 0 or offset + length > self.size:
            raise ShmError(f"range [{offset}, {offset + length}) is outside the {self.size}-byte segment")
        return self._view[offset:offset + length]

    def close(self) -> None:
        """Unmap; the creating side also unlinks. Idempotent."""
        if self._fd < 0:
            return
        self._view.release()
        if self._map is not None:
            try:
                self._map.close()
            except BufferError:  # a caller still holds a view; the mapping goes when it is dropped
                pass
        os.close(self._fd)
        self._fd = -1
        if self.owner:
            (SHM_DIR / self.name).unlink(missing_ok=True)


def _space() -> tuple[int, int] | None:
    """/dev/shm's (free, total) bytes; None when it cannot be read."""
    try:
        st = os.statvfs(SHM_DIR)
    except OSError:
        return None
    return st.f_bavail * st.f_frsize, st.f_blocks * st.f_frsize


def _room() -> str:
    space = _space()
    return "its size unknown" if space is None else f"{_size(space[0])} free of {_size(space[1])}"


def shm_bytes() -> int:
    """/dev/shm's size (0 when it cannot be read)."""
    space = _space()
    return 0 if space is None else space[1]


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n / 2**10:.0f} KiB"


def reap_orphans() -> list[str]:
    """Remove segments whose creating process no longer exists; returns their names. A segment whose
    pid is not found here is removed only if nothing holds its lock: its creator may be alive in
    another pid namespace that shares /dev/shm (a container), where its pid means nothing to us."""
    removed: list[str] = []
    if not SHM_DIR.is_dir():
        return removed
    for path in SHM_DIR.glob("epd-kv-*"):
        m = _NAME.match(path.name)
        if m is None:
            continue
        try:
            os.kill(int(m.group(1)), 0)
        except ProcessLookupError:
            if _unheld(path):
                path.unlink(missing_ok=True)
                removed.append(path.name)
        except PermissionError:  # alive, another user's
            pass
    return removed


def _unheld(path: Path) -> bool:
    """True when no process holds the segment's lock (its creator has closed it or died)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    except OSError:  # gone already, or not ours to open
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:  # held: in use
        return False
    finally:
        os.close(fd)  # (releases the lock, if taken)
    return True


def segment_size_class(size: int, floor: int = 16 << 20) -> int:
    """``size`` rounded up to a size class: at least ``floor``, then four classes per doubling (at most 25%
    over), so pushes of similar lengths share segments instead of each needing one of its exact size."""
    size = max(size, floor)
    step = 1 << max(0, size.bit_length() - 3)
    return -(-size // step) * step


class SegmentPool:
    """The sender's reusable segments. ``take`` lends one of at least ``size`` bytes to one stream;
    ``give`` returns it once the receiver has acknowledged (or the stream failed).

    Segments come in size classes (``segment_size_class``), and a take that no idle segment fits closes
    the largest idle one (too small) before it creates one: the pool never holds more segments than the
    most streams that were open at once, so what it keeps is bounded by the peak of pushes in flight
    rather than growing toward ``max_bytes`` with every new longest prompt.

    ``max_bytes`` bounds the idle segments kept; by default 1 GiB, or a quarter of /dev/shm when that is
    smaller (a container's 64 MiB /dev/shm then keeps 16 MiB idle, not all of it: other users of /dev/shm in
    the pod, NCCL or torch's multiprocessing, need room too), and always one segment of at most half of it.

    A segment idle for ``idle_s`` is closed, except the one given back last: after a burst of pushes the pool
    shrinks back to one segment instead of holding a segment per push of the burst for good (shared memory
    counts against the container's memory limit)."""

    def __init__(self, max_bytes: int | None = None, idle_s: float = 30.0) -> None:
        self.max_bytes = max_bytes if max_bytes is not None else min(1 << 30, shm_bytes() // 4)
        # One idle segment is kept even past max_bytes when it takes at most half of /dev/shm: a pool that
        # could keep none would make, fill and unlink a segment for every push.
        self._keep_one = self.max_bytes if max_bytes is not None else shm_bytes() // 2
        self.idle_s = idle_s
        self._free: list[tuple[SharedSegment, float]] = []  # and when each was given back (monotonic), oldest first
        self._trimmer: threading.Timer | None = None
        self._lock = threading.Lock()

    def take(self, size: int) -> SharedSegment:
        doomed = None
        with self._lock:
            fits = [entry for entry in self._free if entry[0].size >= size]
            if fits:  # the smallest; of those, the one given back last, so the others can go idle and be trimmed
                entry = min(fits, key=lambda e: (e[0].size, -e[1]))
                self._free.remove(entry)
                return entry[0]
            if self._free:  # all too small: replace the largest rather than keep it beside a new one
                doomed = max(self._free, key=lambda e: e[0].size)
                self._free.remove(doomed)
        if doomed is not None:
            doomed[0].close()
        size = segment_size_class(size)
        try:
            return SharedSegment.create(size)
        except ShmError as exc:
            raise ShmError(str(exc), lasting=size > shm_bytes() // 2) from None

    @property
    def idle(self) -> int:
        """Segments waiting in the pool for the next stream."""
        with self._lock:
            return len(self._free)

    def give(self, seg: SharedSegment) -> None:
        with self._lock:
            idle = sum(s.size for s, _ in self._free)
            if idle + seg.size <= self.max_bytes or (not self._free and seg.size <= self._keep_one):
                self._free.append((seg, time.monotonic()))
                if len(self._free) > 1:
                    self._arm(self.idle_s)
                return
        seg.close()

    def _arm(self, delay_s: float) -> None:
        """Under the lock: trim in ``delay_s`` unless a trim is already due."""
        if self._trimmer is not None:
            return
        timer = threading.Timer(delay_s, self._trim)
        timer.daemon = True
        try:
            timer.start()
        except RuntimeError:  # no thread to be had (a pids limit): the next give tries again
            return
        self._trimmer = timer

    def _trim(self) -> None:
        now = time.monotonic()
        with self._lock:
            self._trimmer = None
            # all but the one given back last (the list's end), once idle long enough; the rest at their time
            older, last = self._free[:-1], self._free[-1:]
            doomed = [e for e in older if now - e[1] >= self.idle_s]
            kept = [e for e in older if now - e[1] < self.idle_s]
            self._free = kept + last
            if kept:
                self._arm(max(0.0, kept[0][1] + self.idle_s - now))
        for seg, _ in doomed:
            seg.close()

    def close(self) -> None:
        with self._lock:
            free, self._free = self._free, []
            if self._trimmer is not None:
                self._trimmer.cancel()
                self._trimmer = None
        for seg, _ in free:
            seg.close()


class SegmentCache:
    """The receiver's mappings, by name, so a reused segment is not mapped (and faulted) again.

    ``attach`` counts a user and ``release`` drops it; a mapping evicted (LRU, or its file removed)
    while streams still read it is closed when the last one releases it."""

    def __init__(self, max_segments: int = 8) -> None:
        self.max_segments = max_segments
        self._maps: OrderedDict[str, SharedSegment] = OrderedDict()
        self._users: dict[int, int] = {}  # id(segment) -> streams reading it
        self._retired: set[int] = set()  # evicted while in use
        self._lock = threading.Lock()

    def attach(self, name: str, size: int) -> SharedSegment:
        with self._lock:
            seg = self._maps.get(name)
            if seg is not None and seg.size >= size and (SHM_DIR / name).exists():
                self._maps.move_to_end(name)
                self._users[id(seg)] = self._users.get(id(seg), 0) + 1
                return seg
        seg = SharedSegment.attach(name, size)
        with self._lock:
            old = self._maps.pop(name, None)
            self._maps[name] = seg
            self._users[id(seg)] = 1
            doomed = [old] if old is not None else []
            while len(self._maps) > self.max_segments:
                doomed.append(self._maps.popitem(last=False)[1])
            to_close = self._retire(doomed)
        for s in to_close:
            s.close()
        return seg

    def release(self, seg: SharedSegment) -> None:
        with self._lock:
            n = self._users.get(id(seg), 1) - 1
            self._users[id(seg)] = n
            close = n <= 0 and id(seg) in self._retired
            if close:
                self._retired.discard(id(seg))
                self._users.pop(id(seg), None)
        if close:
            seg.close()

    def _retire(self, segs: list[SharedSegment]) -> list[SharedSegment]:
        """Under the lock: the segments that can close now; the rest close on their last release."""
        now = []
        for s in segs:
            if self._users.get(id(s), 0) > 0:
                self._retired.add(id(s))
            else:
                self._users.pop(id(s), None)
                now.append(s)
        return now

    def prune(self) -> None:
        """Drop mappings whose file the sender has removed."""
        with self._lock:
            gone = [n for n in self._maps if not (SHM_DIR / n).exists()]
            to_close = self._retire([self._maps.pop(n) for n in gone])
        for s in to_close:
            s.close()

    def close(self) -> None:
        with self._lock:
            segs, self._maps = list(self._maps.values()), OrderedDict()
            self._users.clear()
            self._retired.clear()
        for s in segs:
            s.close()
