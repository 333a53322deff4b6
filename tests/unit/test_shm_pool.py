"""The sender's shared-memory segment pool: what it keeps stays bounded by the pushes in flight at once, not
by every new longest prompt."""

from __future__ import annotations

import errno
import os
import time

import pytest

from kvtransfer.shm import SHM_DIR, SegmentPool, ShmError, segment_size_class, shm_available

pytestmark = [pytest.mark.unit, pytest.mark.skipif(not shm_available(), reason="needs a writable /dev/shm")]
MiB = 1 << 20


def test_size_classes_round_up_by_at_most_a_quarter_from_16_mib() -> None:
    assert segment_size_class(1) == segment_size_class(16 * MiB) == 16 * MiB
    for size in (16 * MiB + 1, 21 * MiB, 33 * MiB + 7, 57 * MiB, 100 * MiB, 3000 * MiB + 12345):
        rounded = segment_size_class(size)
        assert size <= rounded <= size * 1.25, (size, rounded)
    assert segment_size_class(57 * MiB) == segment_size_class(60 * MiB) == 64 * MiB  # similar pushes share one


def test_a_pool_holds_no_more_segments_than_pushes_were_in_flight_at_once() -> None:
    """Pushes one after another, each longer than the last (a prefill worker seeing its longest prompt so far
    again and again): the pool keeps one segment, the last one's size class, where it once kept every smaller
    one beside it until 1 GiB was idle. Two in flight at once: two kept. A push that an idle segment fits takes
    it, the smallest that fits."""
    pool = SegmentPool(max_bytes=1 << 30)
    try:
        for size in (17 * MiB, 30 * MiB, 45 * MiB, 70 * MiB):
            seg = pool.take(size)
            assert seg.size == segment_size_class(size)
            pool.give(seg)
            assert pool.idle == 1
        a, b = pool.take(20 * MiB), pool.take(20 * MiB)  # the 80 MiB one fits; a second is made
        assert {a.size, b.size} == {80 * MiB, 20 * MiB}
        pool.give(a)
        pool.give(b)
        assert pool.idle == 2
        small = pool.take(18 * MiB)
        assert small.size == 20 * MiB  # the smallest that fits
        pool.give(small)
        assert pool.idle == 2
    finally:
        pool.close()


def test_a_replaced_segment_is_unlinked() -> None:
    pool = SegmentPool(max_bytes=1 << 30)
    try:
        first = pool.take(17 * MiB)
        pool.give(first)
        second = pool.take(40 * MiB)
        assert not (SHM_DIR / first.name).exists() and (SHM_DIR / second.name).exists()
        pool.give(second)
    finally:
        pool.close()
    assert not (SHM_DIR / second.name).exists()


def test_a_segment_that_dev_shm_has_no_room_for_is_refused_up_front(monkeypatch: pytest.MonkeyPatch) -> None:
    """The segment is allocated when it is made, so a full /dev/shm refuses it with a message that says so and
    what to do, and leaves no file behind. (A sparse segment mapped fine, and the first write past what /dev/shm
    held killed the process with SIGBUS; tests/integration/test_kv_shm_full.py shows it on a real tiny tmpfs.)"""
    before = set(SHM_DIR.glob("epd-kv-*"))

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", full)
    with pytest.raises(ShmError, match=r"/dev/shm has no room for a 16 MiB segment \(.* free of .*\); give the "
                                       r"worker a larger /dev/shm \(docker run --shm-size, the chart's shmSize\)"):
        SegmentPool().take(1)
    assert set(SHM_DIR.glob("epd-kv-*")) == before


def test_segments_idle_past_their_time_are_closed_but_the_last_one_given_back() -> None:
    """A burst of three pushes at once leaves three segments; once idle for ``idle_s`` all but the one given
    back last are closed and unlinked, with no take or give to prompt it (shared memory counts against a
    container's memory limit). One in use meanwhile is not touched, and is kept when it comes back."""
    pool = SegmentPool(max_bytes=1 << 30, idle_s=0.3)
    try:
        a, b, c, d = (pool.take(17 * MiB) for _ in range(4))
        for seg in (a, b, c):
            pool.give(seg)
        assert pool.idle == 3
        time.sleep(1.0)
        assert pool.idle == 1
        assert [(SHM_DIR / s.name).exists() for s in (a, b, c, d)] == [False, False, True, True]
        pool.give(d)  # back after the others' time: kept, and c (idle longest) goes in its turn
        time.sleep(1.0)
        assert pool.idle == 1 and not (SHM_DIR / c.name).exists() and (SHM_DIR / d.name).exists()
        assert pool.take(17 * MiB) is d
        pool.give(d)
    finally:
        pool.close()
    assert not (SHM_DIR / d.name).exists()


def test_steady_traffic_reuses_one_segment_and_the_rest_still_go_idle() -> None:
    """After a burst, one push at a time takes the segment given back last, so the others stay idle and are
    trimmed: taking the one idle longest would have kept every segment of the burst in turn."""
    pool = SegmentPool(max_bytes=1 << 30, idle_s=0.3)
    try:
        burst = [pool.take(17 * MiB) for _ in range(4)]
        for seg in burst:
            pool.give(seg)
        start = time.monotonic()
        # a push every 50 ms, for 1.5 s, then on until the rest went idle (10 s at most: a loaded machine
        # runs the trim timer late; taking the segment idle longest would keep every one of them for good)
        while time.monotonic() - start < 1.5 or (pool.idle > 1 and time.monotonic() - start < 10):
            seg = pool.take(17 * MiB)
            time.sleep(0.01)
            pool.give(seg)
            time.sleep(0.04)
        assert pool.idle == 1
        assert sum((SHM_DIR / s.name).exists() for s in burst) == 1
    finally:
        pool.close()
