"""A decode worker cannot recompute an image request's KV (it never sees the images): when its KV pool runs
out of blocks, such a sequence is preempted only after every sequence it could recompute, and then evicted:
its call ends ABORTED and the scheduler moves the request, which is prefilled again with its images and ends
with the reference's tokens. Before, the decode worker recomputed it from the placeholder tokens alone and
went on with KV that no image gave. Real encode, prefill and decode workers, a real Redis registry."""

from __future__ import annotations

import secrets
import threading
import time

import pytest

from controlplane.backend import ModelInfo
from controlplane.dispatch import Dispatcher, WorkerRequest
from controlplane.scheduler.policies import get_policy
from controlplane.scheduler.scheduler import Scheduler, WorkerView
from controlplane.settings import SchedulerSettings
from controlplane.state.journal import RequestJournal, RequestState
from controlplane.state.keys import Pool
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRegistry
from kvtransfer.auth import TransferSecurity
from workers.decode.service import DecodeService
from workers.run import start_worker
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import CapacityError
from workers.runtime.generate import GenerateRequest, build_prompt, generate
from workers.runtime.sampler import SamplingParams

from dispatch_helpers import png
from redis_fixture import redis_server, state_conn  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
PARAMS = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)


@pytest.fixture
def cluster(default_bundle, state_conn):  # noqa: F811
    codecs = ("fp32",) * default_bundle.config.num_layers
    small = EngineConfig(kv_cache_bytes=4 * 2**20, decode_headroom_tokens=0, warmup=False)
    workers = [start_worker("encode", default_bundle, SECURITY),
               start_worker("prefill", default_bundle, SECURITY, codecs=codecs, config=small),
               start_worker("decode", default_bundle, SECURITY, codecs=codecs, config=small)]
    registry = WorkerRegistry(state_conn, ttl=30)
    for w in workers:
        registry.register(WorkerInfo(w.identity.worker_id, Pool(w.pool), w.address,
                                     load=WorkerLoad(free_kv_blocks=20, total_kv_blocks=20)))
    dispatcher = Dispatcher(SECURITY)
    model = ModelInfo("demo", default_bundle.tokenizer, 8192, default_bundle.image_token_id, 64,
                      default_bundle.eos_token_ids)
    scheduler = Scheduler(model, WorkerView(registry, refresh_s=0.05), dispatcher, get_policy("least_loaded"),
                          SchedulerSettings(), RequestJournal(state_conn))
    yield default_bundle, workers, scheduler, state_conn
    dispatcher.close()
    for w in workers:
        registry.deregister(w.identity.worker_id, w.pool)
        w.stop()
    for key in state_conn.redis.scan_iter(match=state_conn.keys.pattern):
        state_conn.redis.delete(key)


def _hold_every_free_block(engine: Engine):
    deadline = time.monotonic() + 5
    while True:
        try:
            return engine.reserve("hold", engine.stats().blocks_free * engine.cache.block_size)
        except CapacityError:  # the running sequence grew meanwhile
            assert time.monotonic() < deadline, "could not take the free blocks"


def test_an_image_request_evicted_by_a_full_decode_pool_moves_and_ends_as_the_reference(cluster):
    bundle, workers, scheduler, conn = cluster
    decode = workers[2].service
    assert isinstance(decode, DecodeService)
    engine = decode.engine
    images = (png((200, 40, 90)),)
    greq = GenerateRequest(messages=[{"role": "user", "content": [{"type": "image"},
                                                                   {"type": "text", "text": "Describe it."}]}],
                           images=images, params=PARAMS)
    ids, mm = build_prompt(bundle, greq)
    assert mm is not None
    ref = generate(bundle, [greq])[0].token_ids
    tokens: list[int] = []
    timer = None
    for chunk in scheduler.generate(WorkerRequest("evicted", ids, PARAMS, images, mm.positions)):
        tokens.extend(chunk.token_ids)
        if timer is None:  # after the first token its next block is taken; given back a second later
            timer = threading.Timer(1.0, engine.release, [_hold_every_free_block(engine)])
            timer.start()
    assert timer is not None
    timer.join()
    assert tokens == ref
    assert engine.stats().num_preemptions >= 1
    moved = [e for e in RequestJournal(conn).history("evicted") if e.state is RequestState.MIGRATING]
    assert len(moved) == 1 and "cannot recompute" in moved[0].detail, moved
    deadline = time.monotonic() + 10
    while (s := engine.stats()).blocks_free != s.blocks_total or s.num_running:
        assert time.monotonic() < deadline, f"the decode worker still holds work: {s}"
        time.sleep(0.02)
