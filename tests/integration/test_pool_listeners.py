"""The pool manager tells a listening Dispatcher of every replica it kills, on a private local Ray: after a
replica's process dies and is replaced, after a scale-down, and at ``stop()``, the dispatcher holds channels
for live replicas only."""

from __future__ import annotations

import os
import secrets
import signal
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
import ray

from controlplane.dispatch import Dispatcher, Route, WorkerRequest
from controlplane.pools import PoolManager
from controlplane.settings import MiB, Settings
from controlplane.state import LocalRedis
from kvtransfer.auth import TransferSecurity
from workers.runtime.sampler import SamplingParams

from redis_fixture import redis_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = secrets.token_urlsafe(24)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


class _Heard:
    """A second listener: what the manager said, in order."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str]] = []

    def serving(self, address: str) -> None:
        self.events.append(("serving", address))

    def forget(self, address: str) -> None:
        self.events.append(("forget", address))


def _wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.2)


def _run(d: Dispatcher, address: str, rid: str) -> int:
    return sum(len(c.token_ids) for c in d.run(WorkerRequest(rid, [5, 6, 7, 8], GREEDY), Route(address)))


def test_replicas_killed_replaced_or_scaled_away_are_forgotten(redis_server: LocalRedis,  # noqa: F811
                                                               default_ckpt: Path):
    settings = Settings(model=default_ckpt, mode="colocated", transfer={"token": TOKEN},
                        encode={"replicas": 0}, prefill={"replicas": 0},
                        decode={"replicas": 1, "num_cpus": 0.25, "engine": {"kv_cache_bytes": 32 * MiB}})
    manager = PoolManager(settings, redis_server.url, f"listen-{uuid.uuid4().hex[:8]}", TOKEN)
    dispatcher, heard = Dispatcher(TransferSecurity(token=TOKEN)), _Heard()
    manager.listen(dispatcher)
    manager.listen(heard)
    try:
        manager.start()
        (first,) = manager.replicas("decode")
        assert heard.events == [("serving", first.address)]
        assert _run(dispatcher, first.address, "before") == 8

        os.kill(ray.get(first.actor.pid.remote(), timeout=30), signal.SIGKILL)
        _wait_for(lambda: [r.worker_id for r in manager.replicas("decode")] not in ([], [first.worker_id]), 120,
                  "a replacement replica")
        (second,) = manager.replicas("decode")
        assert ("forget", first.address) in heard.events
        assert _run(dispatcher, second.address, "after") == 8
        assert [w.address for w in dispatcher.held()] == [second.address]

        manager.scale("decode", 2)
        third = next(r for r in manager.replicas("decode") if r.worker_id != second.worker_id)
        assert _run(dispatcher, third.address, "scaled") == 8
        assert sorted(w.address for w in dispatcher.held()) == sorted([second.address, third.address])
        manager.scale("decode", 1)  # the newest drains and stops
        (kept,) = manager.replicas("decode")
        assert kept == second and [w.address for w in dispatcher.held()] == [second.address]

        manager.stop()
        assert dispatcher.held() == ()
        assert [e for e, _ in heard.events].count("forget") == 3  # first, third, second
    finally:
        manager.stop()
        dispatcher.close()
