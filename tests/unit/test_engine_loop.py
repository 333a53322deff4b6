"""The engine loop: work posted while a step runs joins the next step together (batching), and the
mailbox never loses or leaks a request (abort before admission, refused adoption, duplicates)."""

from __future__ import annotations

import threading

import pytest

from workers.engine_loop import EngineLoop, LoopFailure, drain_outputs
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import DuplicateRequestError, InvalidRequestError
from workers.runtime.generate import GenerateRequest, generate
from workers.runtime.sampler import SamplingParams
from workers.runtime.sequence import FinishReason

from engine_helpers import assert_no_leaks

pytestmark = [pytest.mark.unit]
GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


@pytest.fixture
def gated(tiny_bundle):
    """A loop whose engine steps only when the test opens the gate, and records each step's batch."""
    engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22))
    gate = threading.Semaphore(0)
    entered = threading.Event()
    batches: list[int] = []
    step = engine.step

    def gated_step():
        entered.set()
        gate.acquire()
        batches.append(len(engine.scheduler.waiting) + len(engine.scheduler.running))
        return step()

    engine.step = gated_step  # type: ignore[method-assign]  # a step that waits on the test
    loop = EngineLoop(engine)
    yield engine, loop, gate, batches, entered
    for _ in range(64):
        gate.release()
    loop.stop()


def test_requests_posted_during_a_step_join_the_next_step_together(tiny_bundle, gated):
    engine, loop, gate, batches, entered = gated
    first = loop.submit("a", [5, 6, 7], GREEDY)
    assert entered.wait(10)  # the loop is inside step 1 with "a" alone; these arrive while it runs
    queues = [loop.submit(f"b{i}", [8 + i, 9, 10], GREEDY) for i in range(5)]
    for _ in range(32):
        gate.release()
    outs = {rid: drain_outputs(q, 30) for rid, q in [("a", first)] + [(f"b{i}", q) for i, q in enumerate(queues)]}
    assert all(o[-1].finished and o[-1].num_output_tokens == 4 for o in outs.values())
    assert batches[:2] == [1, 6], batches  # "a" alone, then the five late requests joined it in one step
    refs = generate(tiny_bundle, [GenerateRequest(prompt_ids=[8 + i, 9, 10], params=GREEDY) for i in range(5)])
    assert [[t for o in outs[f"b{i}"] for t in o.new_token_ids] for i in range(5)] == [r.token_ids for r in refs]
    assert_no_leaks(engine)


def test_abort_before_admission_frees_everything(gated):
    engine, loop, gate, _, _ = gated
    q = loop.submit("x", [5, 6, 7], GREEDY)
    assert loop.abort("x") is True
    out = q.get(timeout=5)
    assert out.finished and out.finish_reason == FinishReason.ABORT
    for _ in range(4):
        gate.release()
    assert loop.abort("x") is False
    assert_no_leaks(engine)


def test_a_duplicate_id_is_refused_and_the_first_request_goes_on(gated):
    engine, loop, gate, _, _ = gated
    q = loop.submit("dup", [5, 6, 7], GREEDY)
    with pytest.raises(DuplicateRequestError):
        loop.submit("dup", [5, 6, 7], GREEDY)
    for _ in range(8):
        gate.release()
    assert drain_outputs(q, 30)[-1].num_output_tokens == 4
    assert_no_leaks(engine)


def test_a_refused_adoption_arrives_as_a_failure_and_releases_the_reservation(tiny_bundle):
    engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22))
    loop = EngineLoop(engine)
    try:
        res = engine.reserve("r", 3)
        q = loop.adopt(res, [5, 6], 7, GREEDY)  # two prompt tokens for a reservation of three
        item = q.get(timeout=5)
        assert isinstance(item, LoopFailure) and isinstance(item.error, InvalidRequestError)
        assert "reservation of 3" in item.message
        assert_no_leaks(engine)
        with pytest.raises(InvalidRequestError):  # refused at once: nothing queued
            loop.submit("bad", [], GREEDY)
        assert_no_leaks(engine)
    finally:
        loop.stop()


def test_a_finished_output_carries_its_engine_time_and_nothing_is_left_behind(gated):
    import time

    engine, loop, gate, _, entered = gated
    q = loop.submit("timed", [5, 6, 7], GREEDY)
    assert entered.wait(10)  # admitted, and held in its first step for a known time
    time.sleep(0.05)
    for _ in range(8):
        gate.release()
    outs = drain_outputs(q, 30)
    assert [o.engine_seconds for o in outs[:-1]] == [0.0] * (len(outs) - 1)
    assert 0.05 <= outs[-1].engine_seconds < 30
    assert loop._admitted == {}  # the admission times go with the request
    assert_no_leaks(engine)


def test_an_idle_loop_lets_the_caller_step_its_own_request(tiny_bundle):
    """run_here on an idle loop: the request is admitted and stepped on the calling thread, its output is
    waiting when run_here returns, and the result equals the single-process reference."""
    engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22))
    stepped_on: list[int] = []
    step = engine.step

    def recording_step():
        stepped_on.append(threading.get_ident())
        return step()

    engine.step = recording_step  # type: ignore[method-assign]  # a step that records
    loop = EngineLoop(engine)
    try:
        q = loop.submit("here", [5, 6, 7], GREEDY, wake=False)
        loop.run_here("here")
        assert q.qsize() >= 1 and set(stepped_on) == {threading.get_ident()}
        outs = drain_outputs(q, 5)
        assert outs[-1].finished and outs[-1].engine_seconds > 0
        ref = generate(tiny_bundle, [GenerateRequest(prompt_ids=[5, 6, 7], params=GREEDY)])[0]
        assert [t for o in outs for t in o.new_token_ids] == ref.token_ids
        assert_no_leaks(engine)
    finally:
        loop.stop()


def test_a_busy_loop_serves_the_request_itself_when_the_caller_cannot_step(gated):
    """While the loop thread is inside a step, run_here returns at once and the loop serves the request."""
    engine, loop, gate, batches, entered = gated
    first = loop.submit("a", [5, 6, 7], GREEDY)
    assert entered.wait(10)  # the loop thread holds the step
    q = loop.submit("b", [8, 9, 10], GREEDY, wake=False)
    loop.run_here("b")  # must not block on the running step
    assert q.empty()
    for _ in range(32):
        gate.release()
    assert drain_outputs(first, 30)[-1].finished and drain_outputs(q, 30)[-1].num_output_tokens == 4
    assert_no_leaks(engine)


def test_a_loop_with_nothing_it_can_run_waits_instead_of_spinning(tiny_bundle):
    """A preempted sequence waiting for blocks that a reservation holds: the engine has work but no step
    can run. The loop must wait for a wake-up (or its poll), not call step() in a hot loop on the engine's
    lock against the threads that would free the blocks."""
    import time

    from workers.runtime.kv_cache import KVCacheSpec

    cfg = tiny_bundle.config
    per_block = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 4).bytes_per_block(
        ("float32",) * cfg.num_layers)
    engine = Engine(tiny_bundle.model, None, EngineConfig(kv_cache_bytes=16 * per_block, block_size=4,
                                                          decode_headroom_tokens=0))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    res = engine.reserve("a", 6, 40)
    engine.add_prefilled(res, [5] * 6, 7, params)
    held = engine.reserve("b", 13 * 4, 1)  # the rest of the pool: "a" is preempted at its next block
    for _ in range(8):
        engine.step()
    assert engine.stats().num_waiting == 1 and engine.has_unfinished()

    calls = 0
    real_step = engine.step

    def counted_step():
        nonlocal calls
        calls += 1
        return real_step()

    engine.step = counted_step  # type: ignore[method-assign]
    loop = EngineLoop(engine)
    try:
        time.sleep(0.5)
        assert engine.stats().num_waiting == 1  # still stuck: nothing freed the blocks
        assert calls < 50, f"the loop stepped {calls} times in 0.5 s with nothing to run (a spin)"
        engine.release(held)  # the blocks come back: the loop's poll finds "a" runnable again
        end = time.monotonic() + 10
        while engine.has_unfinished() and time.monotonic() < end:
            time.sleep(0.01)
        assert not engine.has_unfinished()
    finally:
        loop.stop()
