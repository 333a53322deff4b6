"""Shared-memory segments for the same-host path: the payload moves through a file in /dev/shm and
gRPC carries only control messages.

The sender creates a segment (mode 0600, so only the same user can open it), writes each chunk's
scales and payload at increasing offsets, and unlinks it when the stream ends. The receiver opens
it by name and unlinks it at once (so nothing is left in /dev/shm if the sender dies), reads chunks
in place, and closes it. A same-user process that truncates a segment under the receiver can crash
it (SIGBUS); the segment is private to the user that runs both workers. Names are checked against a fixed pattern, so a
handshake cannot point the receiver at any other file.
"""

from __future__ import annotations

import mmap
import os
import re
import uuid
from pathlib import Path

SHM_DIR = Path("/dev/shm")
_NAME = re.compile(r"^epd-kv-[0-9]+-[0-9a-f]{32}$")


class ShmError(OSError):
    """A segment could not be created, opened, or read at the requested range."""


def shm_available() -> bool:
    return SHM_DIR.is_dir() and os.access(SHM_DIR, os.W_OK)


class SharedSegment:
    def __init__(self, name: str, fd: int, size: int, owner: bool) -> None:
        self.name = name
        self.size = size
        self.owner = owner
        self._fd = fd
        self._map = mmap.mmap(fd, size) if size else None
        self._view = memoryview(self._map) if self._map is not None else memoryview(bytearray())

    @classmethod
    def create(cls, size: int) -> "SharedSegment":
        if not shm_available():
            raise ShmError(f"{SHM_DIR} is not available for shared memory")
        name = f"epd-kv-{os.getpid()}-{uuid.uuid4().hex}"
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            raise ShmError(f"cannot create shared memory {path}: {exc.strerror}") from None
        try:
            os.ftruncate(fd, size)
            return cls(name, fd, size, owner=True)
        except OSError as exc:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise ShmError(f"cannot size shared memory {path} to {size} bytes: {exc.strerror}") from None

    @classmethod
    def attach(cls, name: str, size: int) -> "SharedSegment":
        if not _NAME.match(name):
            raise ShmError(f"invalid shared-memory name {name!r}")
        path = SHM_DIR / name
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW)
        except OSError as exc:
            raise ShmError(f"cannot open {path} ({exc.strerror}); sender and receiver may not share a host") from None
        # Unlink at once: both mappings stay valid, and no file outlives a sender that dies mid-stream.
        path.unlink(missing_ok=True)
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
