"""The prefix cache in the workers, on real gRPC servers: a prefill worker that reuses a cached prefix streams
the prompt's KV (the cached blocks read from its pool) but for the blocks the decode worker's own prefix cache
holds (its Holds reply says how many), and decode's tokens equal the single-process reference; image
requests cache only the blocks before their first image, on the prefill and the decode worker alike; and
the hit counters reach the heartbeat (a real Redis), ``epd status`` and /metrics."""

from __future__ import annotations

import secrets
from dataclasses import asdict

import pytest

from controlplane.admin import pools_status
from controlplane.admin_client import format_status
from controlplane.dispatch import Dispatcher, Route, WorkerRequest
from controlplane.observability import metrics
from controlplane.pools.replica import Lease
from controlplane.state import WorkerRegistry
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from workers.colocated.service import ColocatedService
from workers.engine_loop import drain_outputs
from workers.run import start_worker
from workers.runtime.engine import EngineConfig
from workers.runtime.generate import GenerateRequest, build_prompt, generate
from workers.runtime.sampler import SamplingParams

from dispatch_helpers import png, run_request
from redis_fixture import redis_server, state_conn  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
SYSTEM = ("You are a careful assistant for a shipping company. Answer in one short sentence, name the port "
          "and the ship, and never guess a date you were not given. ") * 3


@pytest.fixture(scope="module")
def stack(default_bundle):
    codecs = ("int8",) * default_bundle.config.num_layers  # the cached blocks go out through a real codec too
    workers = {pool: start_worker(pool, default_bundle, SECURITY, codecs=codecs,
                                  config=EngineConfig(kv_cache_bytes=64 * 2**20))
               for pool in ("encode", "prefill", "decode")}
    dispatcher = Dispatcher(SECURITY)
    yield default_bundle, workers, dispatcher, Route(workers["decode"].address, workers["prefill"].address,
                                                     workers["encode"].address)
    dispatcher.close()
    for w in workers.values():
        w.stop()


def _status(address: str, stub_cls) -> wpb.WorkerStatus:
    with SECURITY.open_channel(address) as ch:
        return stub_cls(ch).Status(wpb.StatusRequest(), metadata=SECURITY.call_metadata(), timeout=5)


def _chat(question: str) -> GenerateRequest:
    return GenerateRequest(messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
                           params=GREEDY)


def test_a_cached_system_prompt_is_reused_and_decode_gets_the_kv_it_lacks(stack):
    bundle, workers, dispatcher, route = stack
    questions = ["Where is the Aurora docked?", "Which ship left Rotterdam?", "Where is the Aurora docked?"]
    block = workers["prefill"].service.engine.cache.block_size
    before = _status(workers["prefill"].address, wgrpc.PrefillWorkerStub)
    decode_before = _status(workers["decode"].address, wgrpc.DecodeWorkerStub)
    for i, q in enumerate(questions):
        greq = _chat(q)
        ids, _ = build_prompt(bundle, greq)
        ref = generate(bundle, [greq])[0]  # an engine of its own, the cache empty
        tokens, text, _ = run_request(dispatcher, route, WorkerRequest(f"sys-{i}", ids, GREEDY))
        # int8 on the wire: the reference for that is decode fed the same quantised KV; tokens agree here
        assert tokens == ref.token_ids, (q, text, ref.text)
    after = _status(workers["prefill"].address, wgrpc.PrefillWorkerStub)
    shared = len(build_prompt(bundle, _chat(""))[0]) // block * block  # at least the system prompt's blocks
    hits = after.prefix_cache_hits - before.prefix_cache_hits
    assert hits >= 2 * (shared - block), (hits, shared)  # the second and the third found it (the third, more)
    assert after.prefix_cache_queries - before.prefix_cache_queries == sum(
        len(build_prompt(bundle, _chat(q))[0]) for q in questions)
    # the decode worker indexed the first request's KV as it arrived: the later pushes skipped those blocks
    decode_after = _status(workers["decode"].address, wgrpc.DecodeWorkerStub)
    assert decode_after.prefix_cache_hits - decode_before.prefix_cache_hits >= 2 * (shared - block)
    for pool, stub in (("decode", wgrpc.DecodeWorkerStub), ("prefill", wgrpc.PrefillWorkerStub)):
        s = _status(workers[pool].address, stub)
        assert (s.kv_blocks_free, s.reservations, s.running, s.waiting) == (s.kv_blocks_total, 0, 0, 0), (pool, s)


def test_image_requests_cache_only_the_blocks_before_the_image(stack):
    """Same text, different images: the second request's output is its own image's (the reference), and
    neither worker indexed a block at or after an image placeholder."""
    bundle, workers, dispatcher, route = stack
    engines = {pool: workers[pool].service.engine for pool in ("prefill", "decode")}
    block = engines["prefill"].cache.block_size
    for i, color in enumerate(((200, 30, 30), (30, 30, 200))):
        images = (png(color),)
        greq = GenerateRequest(messages=[{"role": "system", "content": SYSTEM},
                                         {"role": "user", "content": [{"type": "image"},
                                                                      {"type": "text", "text": "What is it?"}]}],
                               images=images, params=GREEDY)
        ids, mm = build_prompt(bundle, greq)
        assert mm is not None and mm.positions[0] >= 2 * block
        for eng in engines.values():
            eng.reset_prefix_cache()  # only this request's blocks are indexed next
        ref = generate(bundle, [greq])[0]
        tokens, _, _ = run_request(dispatcher, route, WorkerRequest(f"img-{i}", ids, GREEDY, images, mm.positions))
        assert tokens == ref.token_ids
        for pool, eng in engines.items():
            assert eng.cache.allocator.num_cached == mm.positions[0] // block, pool


def test_hit_counters_reach_status_and_metrics(default_bundle, state_conn):  # noqa: F811
    worker = start_worker("decode", default_bundle, SECURITY, colocated=True,
                          config=EngineConfig(kv_cache_bytes=32 * 2**20, warmup=False))
    service = worker.service
    assert isinstance(service, ColocatedService)
    registry = WorkerRegistry(state_conn, ttl=30)
    lease = Lease(registry, worker)
    try:
        prompt = default_bundle.tokenizer.encode(SYSTEM)
        for i in range(2):
            assert drain_outputs(service.loop.submit(f"c{i}", prompt, GREEDY), 30)[-1].finished
        stats = service.engine.stats()
        block = service.engine.cache.block_size
        assert stats.prefix_cache_hits == (len(prompt) - 1) // block * block and stats.prefix_cache_queries == 2 * len(
            prompt)
        lease.start()
        views = pools_status(state_conn, registry)
        [w] = next(v for v in views if v.pool == "decode").workers
        assert (w.prefix_cache_queries, w.prefix_cache_hits) == (stats.prefix_cache_queries, stats.prefix_cache_hits)
        share = 100 * stats.prefix_cache_hits / stats.prefix_cache_queries
        assert f"prefix_hits={share:.0f}%" in format_status({"pools": [asdict(v) for v in views]})
        metrics.bind_cluster(metrics.PoolsSource(lambda: pools_status(state_conn, registry)))
        try:
            body = metrics.exposition().decode()
        finally:
            metrics.bind_cluster(None)
        labels = f'{{model_name="{metrics.MODEL.value}",pool="decode",worker_id="{worker.identity.worker_id}"}}'
        assert f"epd:prefix_cache_queries_total{labels} {float(stats.prefix_cache_queries)}" in body
        assert f"epd:prefix_cache_hits_total{labels} {float(stats.prefix_cache_hits)}" in body
        assert "# TYPE epd:prefix_cache_hits_total counter" in body
    finally:
        lease.stop()
        worker.stop()


def test_a_prefill_worker_that_sends_every_block_gets_fresh_ones_on_decode(stack, monkeypatch):
    """A prefill worker from before cached blocks asks Holds without ``skips_cached_blocks`` and pushes every
    block (a rolling update's mixed pools): the decode worker puts fresh blocks in place of the ones its
    prefix cache lent the reservation, the push lands whole, and the tokens equal the reference."""
    bundle, workers, dispatcher, route = stack
    prefill = workers["prefill"].service
    greq = _chat("Which port is the Aurora bound for?")
    ids, _ = build_prompt(bundle, greq)
    ref = generate(bundle, [greq])[0]
    assert run_request(dispatcher, route, WorkerRequest("warm-decode", ids, GREEDY))[0] == ref.token_ids

    asked: list[wpb.HoldsReply] = []

    def older(rid: str, target: str, num_tokens: int, timeout: float) -> int:
        stub = wgrpc.DecodeWorkerStub(prefill.sender.channel(target))
        reply = stub.Holds(wpb.HoldsRequest(request_id=rid, num_tokens=num_tokens),
                           metadata=prefill.sender.security.call_metadata(), timeout=10)
        asked.append(reply)
        return 0  # it knows of no cached blocks: its push sends them all

    monkeypatch.setattr(prefill, "_check_reservation", older)
    decode = workers["decode"].service.engine
    cached = decode.stats().cached_blocks
    tokens, _, _ = run_request(dispatcher, route, WorkerRequest("older-prefill", ids, GREEDY))
    assert tokens == ref.token_ids
    assert [(r.held, r.cached_blocks) for r in asked] == [(True, 0)]
    assert decode.stats().cached_blocks >= cached  # the lent blocks went back to the cache, not lost
    s = _status(workers["decode"].address, wgrpc.DecodeWorkerStub)
    assert (s.kv_blocks_free, s.reservations, s.running) == (s.kv_blocks_total, 0, 0)
