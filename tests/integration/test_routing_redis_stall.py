"""Routing while Redis stalls: each read has one bounded try, then the last good snapshot is used and
the view says it is degraded, until Redis answers again."""

from __future__ import annotations

import os
import signal
import time
import uuid

import pytest

from controlplane.scheduler.worker_view import WorkerView
from controlplane.state import LocalRedis, Pool, connect
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRegistry

pytestmark = [pytest.mark.integration]


def test_a_stalled_redis_costs_one_bounded_read_then_routing_uses_its_last_snapshot():
    with LocalRedis() as server:
        conn = connect(server.url, f"t-{uuid.uuid4().hex[:8]}")
        fast = conn.with_budget(0.2)
        now = [0.0]
        view = WorkerView(WorkerRegistry(fast, ttl=60), refresh_s=0.2, clock=lambda: now[0], degraded_retry_s=1.0)
        WorkerRegistry(conn, ttl=60).register(WorkerInfo("d-0", Pool.DECODE, "127.0.0.1:9", load=WorkerLoad()))
        assert [c.worker_id for c in view.candidates("decode")] == ["d-0"] and view.degraded is None
        os.kill(server.pid, signal.SIGSTOP)
        try:
            now[0] = 1.0
            began = time.monotonic()
            assert [c.worker_id for c in view.candidates("decode")] == ["d-0"]  # the last good snapshot
            assert time.monotonic() - began < 1.0  # one try within the budget, not retries for seconds
            assert view.degraded is not None and "Redis" in view.degraded.reason
            began = time.monotonic()
            for _ in range(20):  # within the retry interval nobody waits on Redis again
                view.candidates("decode")
            assert time.monotonic() - began < 0.1
            with pytest.raises(Exception, match="Redis"):  # a pool never read has no snapshot to fall back on
                view.candidates("prefill")
        finally:
            os.kill(server.pid, signal.SIGCONT)
        now[0] = 3.0
        assert [c.worker_id for c in view.candidates("decode")] == ["d-0"] and view.degraded is None
        fast.close()
        conn.redis.flushdb()
        conn.close()


def test_a_pool_emptied_by_a_redis_restart_keeps_routing_until_its_workers_register_again():
    with LocalRedis() as server:
        conn = connect(server.url, f"t-{uuid.uuid4().hex[:8]}")
        now = [0.0]
        registry = WorkerRegistry(conn, ttl=5)
        view = WorkerView(registry, refresh_s=0.2, clock=lambda: now[0])
        registry.register(WorkerInfo("p-0", Pool.PREFILL, "127.0.0.1:9", load=WorkerLoad()))
        assert [c.worker_id for c in view.candidates("prefill")] == ["p-0"]
        conn.redis.flushdb()  # what a restarted Redis holds until the next heartbeat
        now[0] = 1.0
        assert [c.worker_id for c in view.candidates("prefill")] == ["p-0"]  # within one lease: kept
        now[0] = 7.0
        assert view.candidates("prefill") == []  # past it: the pool is empty indeed
        registry.register(WorkerInfo("p-1", Pool.PREFILL, "127.0.0.1:10", load=WorkerLoad()))
        now[0] = 8.0
        assert [c.worker_id for c in view.candidates("prefill")] == ["p-1"]
        conn.redis.flushdb()
        conn.close()
