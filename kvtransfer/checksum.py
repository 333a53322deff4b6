"""Checksums: xxh3-64 over each chunk's bytes (several GB/s, so never the bottleneck), and a
stream checksum over the chunk checksums in order."""

from __future__ import annotations

from collections.abc import Iterable

import xxhash


def chunk_checksum(parts: Iterable[memoryview]) -> int:
    h = xxhash.xxh3_64()
    for part in parts:
        h.update(part)
    return h.intdigest()


class ChunkHasher:
    """``chunk_checksum`` fed part by part, so a caller can hash each piece while it is in cache."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def update(self, part: memoryview) -> None:
        self._h.update(part)

    @property
    def value(self) -> int:
        return self._h.intdigest()


class StreamChecksum:
    """Order-sensitive digest of the chunk checksums of a stream."""

    def __init__(self) -> None:
        self._h = xxhash.xxh3_64()

    def add(self, checksum: int) -> None:
        self._h.update(checksum.to_bytes(8, "little"))

    @property
    def value(self) -> int:
        return self._h.intdigest()
