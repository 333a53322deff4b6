"""A worker's preemptions reach the operator: its engine's count goes into its heartbeat (a real Redis), out
through /admin/pools (``epd status``), the dashboard's data and /metrics as ``epd:num_preemptions_total`` per worker."""

from __future__ import annotations

import secrets
from dataclasses import asdict

import pytest

from controlplane.admin import pools_status
from controlplane.admin_client import format_status
from controlplane.api.dashboard import dashboard_state
from controlplane.observability import metrics
from controlplane.pools.replica import Lease
from controlplane.state import WorkerRegistry
from kvtransfer.auth import TransferSecurity
from workers.engine_loop import drain_outputs
from workers.run import start_worker
from workers.runtime.engine import EngineConfig
from workers.runtime.kv_cache import KVCacheSpec
from workers.runtime.sampler import SamplingParams

from redis_fixture import redis_server, state_conn  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration]

SECURITY = TransferSecurity(token=secrets.token_urlsafe(24))


@pytest.fixture
def cramped(tiny_bundle):
    """A colocated worker whose KV pool (12 blocks of 8 tokens) holds one 88-token sequence, not two."""
    cfg = tiny_bundle.config
    per_block = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, 8).bytes_per_block(
        ("float32",) * cfg.num_layers)
    worker = start_worker("decode", tiny_bundle, SECURITY, colocated=True,
                          config=EngineConfig(kv_cache_bytes=12 * per_block, block_size=8, warmup=False))
    yield worker
    worker.stop()


def test_preemptions_are_heartbeat_shown_by_status_and_exported_per_worker(cramped, state_conn):  # noqa: F811
    loop, engine = cramped.service.loop, cramped.service.engine
    assert engine.cache.num_blocks == 12
    params = SamplingParams(max_tokens=80, temperature=0.0, ignore_eos=True)
    queues = [loop.submit(f"r{i}", [1] + [3 + i] * 7, params) for i in range(2)]  # 8 + 80 tokens: 11 blocks each
    for q in queues:
        assert drain_outputs(q, 30)[-1].finished
    preempted = engine.stats().num_preemptions
    assert preempted > 0, "two 11-block sequences in a 12-block pool were meant to preempt"

    registry = WorkerRegistry(state_conn, ttl=30)
    lease = Lease(registry, cramped)
    lease.start()
    try:
        views = pools_status(state_conn, registry)
        [worker] = next(v for v in views if v.pool == "decode").workers
        assert (worker.worker_id, worker.preemptions) == (cramped.identity.worker_id, preempted)
        status = format_status({"pools": [asdict(v) for v in views]})  # what /admin/pools answers
        assert f"preemptions={preempted}" in status
        state = dashboard_state(lambda: pools_status(state_conn, registry), None)  # /dashboard's data
        [shown] = next(p for p in state["pools"] if p["pool"] == "decode")["workers"]
        assert shown["preemptions"] == preempted

        metrics.bind_cluster(metrics.PoolsSource(lambda: pools_status(state_conn, registry)))
        try:
            body = metrics.exposition().decode()
        finally:
            metrics.bind_cluster(None)
        series = (f'epd:num_preemptions_total{{model_name="{metrics.MODEL.value}",pool="decode",'
                  f'worker_id="{cramped.identity.worker_id}"}} {float(preempted)}')
        assert series in body
        assert "# TYPE epd:num_preemptions_total counter" in body
    finally:
        lease.stop()


def test_a_lease_written_by_older_code_without_the_count_reads_as_zero(state_conn):  # noqa: F811
    """A worker of older code writes no ``preemptions`` field; its record still reads (as 0), so a rolling
    upgrade's mixed pool stays visible to routing and status."""
    from controlplane.state.keys import Pool
    from controlplane.state.registry import WorkerInfo, WorkerLoad

    registry = WorkerRegistry(state_conn, ttl=30)
    registry.register(WorkerInfo("decode-old", Pool.DECODE, "127.0.0.1:5001",
                                 load=WorkerLoad(free_kv_blocks=3, total_kv_blocks=4)))
    try:
        assert state_conn.redis.hdel(state_conn.keys.worker(Pool.DECODE, "decode-old"), "preemptions") == 1
        [record] = registry.live_workers(Pool.DECODE)
        assert (record.info.worker_id, record.info.load.preemptions, record.info.load.free_kv_blocks) == (
            "decode-old", 0, 3)
    finally:
        registry.deregister("decode-old", Pool.DECODE)
