"""``BufferPool``: the sender's reusable chunk buffers."""

from __future__ import annotations

import pytest

from kvtransfer.memory import BufferPool

pytestmark = pytest.mark.unit


def test_a_given_buffer_is_handed_out_again_for_a_chunk_it_fits() -> None:
    pool = BufferPool(max_bytes=1 << 20)
    a = pool.take(1000)
    assert a.numel() == 1000
    pool.give(a)
    assert pool.idle_bytes == 1000
    b = pool.take(900)  # fits: the same memory comes back
    assert b.data_ptr() == a.data_ptr() and pool.idle_bytes == 0
    c = pool.take(900)  # none idle: a new one
    assert c.data_ptr() != a.data_ptr() and c.numel() == 900


def test_a_buffer_over_twice_the_need_is_not_used_for_a_small_chunk() -> None:
    pool = BufferPool(max_bytes=1 << 20)
    big = pool.take(10_000)
    pool.give(big)
    small = pool.take(4_000)
    assert small.data_ptr() != big.data_ptr() and small.numel() == 4_000
    assert pool.idle_bytes == 10_000
    assert pool.take(6_000).data_ptr() == big.data_ptr()  # within 2x: used


def test_the_smallest_fitting_buffer_is_chosen_and_idle_bytes_stay_under_the_cap() -> None:
    pool = BufferPool(max_bytes=3_000)
    bufs = [pool.take(n) for n in (1_000, 1_500, 1_200)]
    for b in bufs:
        pool.give(b)
    assert pool.idle_bytes == 2_500  # the 1_200 one would have gone over 3_000: dropped
    assert pool.take(1_100).data_ptr() == bufs[1].data_ptr()  # 1_500 is the only one >= 1_100
    assert pool.take(900).data_ptr() == bufs[0].data_ptr()
    pool.give(pool.take(10))
    pool.clear()
    assert pool.idle_bytes == 0
