"""Keepalive chunks on a worker's token stream (real gRPC worker, real Dispatcher): a request that waits
while its engine steps (preempted, waiting for KV blocks) is not taken for a hung worker, and a stuck
engine still is. A bad ``keepalive_s``: tests/integration/test_worker_rpc_bad_input.py."""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from controlplane.cancellation import ClientGone
from controlplane.dispatch import Dispatcher, DispatchError, Route, WorkerRequest
from epd.worker.v1 import worker_pb2 as wpb
from kvtransfer.auth import TransferSecurity
from workers.engine_loop import drain_outputs
from workers.run import start_worker
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import CapacityError
from workers.runtime.kv_cache import KVCacheSpec
from workers.runtime.sampler import SamplingParams

from engine_helpers import run_to_completion

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
PROMPT = [1] + [7] * 7
PARAMS = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)  # 8 + 80 tokens: 11 of 12 blocks
IDLE_S = 0.5  # the dispatcher's token idle limit here; its keepalive is a third of it


@pytest.fixture
def worker(tiny_bundle):
    """A colocated worker with 12 KV blocks of 8 tokens and no decode headroom, so a test can take the
    blocks a running sequence needs next."""
    cfg = tiny_bundle.config
    per_block = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8).bytes_per_block(
        ("float32",) * cfg.num_layers)
    w = start_worker("decode", tiny_bundle, SECURITY, colocated=True,
                     config=EngineConfig(kv_cache_bytes=12 * per_block, block_size=8, decode_headroom_tokens=0,
                                         warmup=False))
    yield w
    w.stop()


@pytest.fixture
def dispatcher():
    d = Dispatcher(SECURITY, token_idle_timeout_s=IDLE_S)
    yield d
    d.close()


def _reference(bundle) -> list[int]:
    engine = Engine(bundle.model, None, EngineConfig(kv_cache_bytes=1 << 22))
    engine.add_request("ref", PROMPT, PARAMS)
    return [o.new_token_ids[0] for o in run_to_completion(engine)["ref"]]


def _hold_every_free_block(engine: Engine):
    """A reservation of every block free now (the running sequence grows meanwhile: retried)."""
    deadline = time.monotonic() + 5
    while True:
        free = engine.stats().blocks_free
        try:
            return engine.reserve("hold", free * 8)
        except CapacityError:
            assert time.monotonic() < deadline, "could not take the free blocks"


def _wait_idle(engine: Engine) -> None:
    deadline = time.monotonic() + 10
    s = engine.stats()
    while (s.blocks_free, s.num_running, s.num_waiting) != (s.blocks_total, 0, 0):
        assert time.monotonic() < deadline, f"the worker still holds work: {s}"
        time.sleep(0.02)
        s = engine.stats()


def test_a_preempted_request_waiting_for_blocks_is_kept_alive_and_finishes_as_alone(worker, dispatcher,
                                                                                    tiny_bundle):
    engine = worker.service.engine
    tokens: list[int] = []
    chunks: list[wpb.TokenChunk] = []
    release: threading.Timer | None = None
    for chunk in dispatcher.run(WorkerRequest("kept", PROMPT, PARAMS), Route(worker.address)):
        chunks.append(chunk)
        tokens.extend(chunk.token_ids)
        if release is None:  # after the first token: its next block is taken, for four idle limits
            release = threading.Timer(4 * IDLE_S, engine.release, [_hold_every_free_block(engine)])
            release.start()
    assert release is not None
    release.join()
    assert engine.stats().num_preemptions >= 1, "the request was meant to be preempted and wait"
    assert tokens == _reference(tiny_bundle)  # recomputed after the wait, the same tokens as alone
    assert chunks[-1].finished and chunks[-1].finish_reason == "length"
    assert all(c.token_ids for c in chunks) and not any(c.keepalive for c in chunks)  # none reach the caller
    _wait_idle(engine)


def test_a_request_that_waits_past_max_stall_s_is_moved_off_its_worker_which_is_not_lost(worker, tiny_bundle):
    """Keepalives alone for the request's ``max_stall_s`` (the scheduler sets it when another replica could
    take the request): the call is cancelled (its request freed there) and the worker named stalled, not
    lost: the scheduler moves the request without marking a live worker suspect."""
    engine = worker.service.engine
    stalling = Dispatcher(SECURITY, token_idle_timeout_s=IDLE_S)
    release: threading.Timer | None = None
    try:
        stream = stalling.run(WorkerRequest("stalled", PROMPT, PARAMS, max_stall_s=2 * IDLE_S), Route(worker.address))
        started = time.monotonic()
        with pytest.raises(DispatchError) as caught:
            for _ in stream:
                if release is None:  # after the first token: its next block is taken, for eight idle limits
                    release = threading.Timer(8 * IDLE_S, engine.release, [_hold_every_free_block(engine)])
                    release.start()
        waited = time.monotonic() - started
    finally:
        stalling.close()
    assert caught.value.stalled == (worker.address,) and caught.value.lost == ()
    assert "keepalives but no token" in caught.value.message
    assert waited < 8 * IDLE_S  # moved before the blocks came back
    assert release is not None
    release.join()
    _wait_idle(engine)  # the cancelled call freed the request there


def test_an_engine_stuck_in_one_step_sends_no_keepalive_and_reads_as_hung(worker, dispatcher):
    engine = worker.service.engine
    unstick = threading.Event()

    def stuck(event) -> None:  # the step that prefills "stuck" never ends (until the test lets it)
        if any(c.request_id == "stuck" for c in event.chunks):
            unstick.wait(30)

    engine.add_layer_hook(stuck)
    stream = dispatcher.run(WorkerRequest("watched", PROMPT, PARAMS), Route(worker.address))
    try:
        first = next(stream)
        assert first.token_ids
        q = worker.service.loop.submit("stuck", PROMPT, SamplingParams(max_tokens=1, temperature=0.0))
        started = time.monotonic()
        with pytest.raises(DispatchError) as caught:
            for _ in stream:
                pass
        waited = time.monotonic() - started
    finally:
        unstick.set()
        stream.close()
    assert caught.value.lost == (worker.address,) and "sent nothing" in caught.value.message
    assert waited < 10 * IDLE_S  # found within its idle limit (and the watch's tick), not kept alive
    assert drain_outputs(q, 30)[-1].finished
    engine.remove_layer_hook(stuck)
    _wait_idle(engine)


def test_a_preempted_request_whose_client_leaves_is_aborted_while_it_waits(worker, dispatcher):
    """The request waits there for blocks (keepalives only) and its client leaves (the ingress cancels it): the
    call is cancelled then, and the worker drops the request, instead of keeping it until its blocks come back
    and its next token is sent to nobody."""
    engine = worker.service.engine
    req = WorkerRequest("left", PROMPT, PARAMS, timeout_s=40 * IDLE_S)  # a call not cancelled ends at this deadline
    tokens: list[int] = []
    hold = None
    started = time.monotonic()
    try:
        with pytest.raises(ClientGone):
            for chunk in dispatcher.run(req, Route(worker.address)):
                tokens.extend(chunk.token_ids)
                if hold is None:  # after the first token: its next block is taken; then its client leaves
                    hold = _hold_every_free_block(engine)
                    threading.Timer(2 * IDLE_S, req.cancel.cancel).start()
        assert time.monotonic() - started < 20 * IDLE_S, "the call ran to its deadline: the cancel did not end it"
        deadline = time.monotonic() + 10
        while (s := engine.stats()).num_running + s.num_waiting:  # dropped while the blocks are still held
            assert time.monotonic() < deadline, f"the worker kept the request: {s}"
            time.sleep(0.02)
        assert len(tokens) < PARAMS.max_tokens
    finally:
        if hold is not None:
            engine.release(hold)
    _wait_idle(engine)
