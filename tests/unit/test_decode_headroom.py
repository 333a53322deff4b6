"""A disaggregated decode engine takes a new request's KV only while the sequences it runs can still grow
(``decode_headroom_tokens``): a reservation must never leave a running sequence without a block for its
next token, since a preempted sequence goes silent until all of its blocks are free again and then
recomputes its whole context (the control plane takes that silence for a hung worker)."""

from __future__ import annotations

import logging

import pytest

from controlplane.settings import EngineSettings
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import CapacityError
from workers.runtime.sampler import SamplingParams

BLOCK = 4


def _engine(tiny_bundle, headroom: int, blocks: int = 16) -> Engine:
    probe = Engine(tiny_bundle.model, None, EngineConfig(block_size=BLOCK, kv_cache_bytes=1 << 20))
    per_block = (1 << 20) // probe.cache.num_blocks
    engine = Engine(tiny_bundle.model, None, EngineConfig(block_size=BLOCK, kv_cache_bytes=per_block * blocks,
                                                          decode_headroom_tokens=headroom))
    assert engine.cache.num_blocks == blocks
    return engine


def _running(engine: Engine, rid: str, prompt_len: int, max_tokens: int) -> None:
    """A sequence adopted as a decode worker adopts one: its reserved prompt KV 'arrived' (zeros)."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    res = engine.reserve(rid, prompt_len, max_tokens)
    engine.add_prefilled(res, [5] * prompt_len, 7, params)


def _steps(engine: Engine, n: int) -> None:
    for _ in range(n):
        engine.step()


def test_a_reservation_that_would_starve_a_running_sequence_is_refused(tiny_bundle) -> None:
    engine = _engine(tiny_bundle, headroom=8)
    _running(engine, "a", 6, 40)  # 7 tokens in 2 blocks; 8 more tokens take 2 more blocks
    with pytest.raises(CapacityError, match="need 13 KV blocks for the prompt and 3 left free"):
        engine.reserve("b", 13 * BLOCK, 1)  # 13 + a's 2 + its own 1 > 14 free
    assert engine.stats().blocks_free == 14  # the refusal took nothing
    engine.reserve("b", 11 * BLOCK, 1)  # 11 + 2 + 1 = 14: fits
    _steps(engine, 8)  # a grows by its 8 tokens of headroom...
    assert engine.stats().num_preemptions == 0  # ...without being preempted


def test_without_headroom_the_same_reservation_preempts_the_running_sequence(tiny_bundle, caplog) -> None:
    """What the headroom prevents (and why a reservation waits while a preempted sequence does)."""
    engine = _engine(tiny_bundle, headroom=0)
    _running(engine, "a", 6, 40)
    engine.reserve("b", 13 * BLOCK, 1)
    with caplog.at_level(logging.WARNING, logger="workers.runtime.engine"):
        _steps(engine, 8)
    assert engine.stats().num_preemptions == 1 and engine.stats().num_waiting == 1
    warnings = [r.getMessage() for r in caplog.records if "preempted" in r.getMessage()]
    assert len(warnings) == 1 and "1 sequence(s) preempted (1 since start)" in warnings[0]
    with pytest.raises(CapacityError, match="1 preempted sequences wait for KV blocks here"):
        engine.reserve("c", 1, 1)


def test_headroom_counts_reservations_and_stops_at_each_max_tokens(tiny_bundle) -> None:
    engine = _engine(tiny_bundle, headroom=64)
    engine.reserve("r1", 2 * BLOCK, BLOCK)  # may grow one block (to its max_tokens), not 16 (the headroom)
    _running(engine, "a", BLOCK - 1, 2)  # 4 tokens in 1 block after its first; may grow one more
    # 13 free; kept: r1 1, a 1, and the new one's own block (its max_tokens 3 crosses one boundary)
    engine.reserve("r2", 10 * BLOCK - 1, 3)
    with pytest.raises(CapacityError, match="need 1 KV blocks for the prompt and 3 left free"):
        engine.reserve("r3", 1, 0)  # 3 free, all of them kept for the three to grow


@pytest.mark.parametrize("prompt_len, max_tokens", [(1, 16 * BLOCK - 1), (16 * BLOCK - 2, 2), (30, 34)])
def test_alone_a_request_that_fits_the_pool_always_fits(tiny_bundle, prompt_len: int, max_tokens: int) -> None:
    engine = _engine(tiny_bundle, headroom=10_000)
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.check_request([5] * prompt_len, params)
    res = engine.reserve("a", prompt_len, max_tokens)
    engine.add_prefilled(res, [5] * prompt_len, 7, params)
    while engine.stats().num_running:
        engine.step()
    assert engine.stats().num_preemptions == 0 and engine.stats().blocks_free == 16


def test_the_setting_reaches_the_engine_and_a_negative_one_is_refused() -> None:
    assert EngineSettings().engine_config().decode_headroom_tokens == 256
    assert EngineSettings(decode_headroom_tokens=0).engine_config().decode_headroom_tokens == 0
    with pytest.raises(ValueError, match="decode_headroom_tokens"):
        EngineSettings(decode_headroom_tokens=-1)
