"""The started WorkerView over a real Redis: a background thread keeps the snapshot fresh, so routing
never reads Redis once a pool was read; a worker that registers, reports overload or goes away shows up
without a request rereading; a stalled Redis leaves the last snapshot in use, degraded, logged once; and
``close()`` leaves no thread behind."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import uuid
from collections.abc import Callable

import pytest

from controlplane.scheduler.worker_view import WorkerView
from controlplane.state import LocalRedis, Pool, connect
from controlplane.state.errors import StateError
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRegistry

pytestmark = [pytest.mark.integration]


class _Reads(WorkerRegistry):
    """The real registry, noting which thread reads each pool."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.readers: list[str] = []

    def live_workers(self, pool):
        self.readers.append(threading.current_thread().name)
        return super().live_workers(pool)


def _wait_for(cond: Callable[[], bool], what: str, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def _threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name == "worker-view"]


def _worker(worker_id: str, port: int, free: int = 20) -> WorkerInfo:
    return WorkerInfo(worker_id, Pool.DECODE, f"127.0.0.1:{port}",
                      load=WorkerLoad(free_kv_blocks=free, total_kv_blocks=20))


def test_the_refresher_keeps_routing_off_redis_and_sees_workers_come_overload_and_go():
    with LocalRedis() as server:
        conn = connect(server.url, f"t-{uuid.uuid4().hex[:8]}")
        writer = WorkerRegistry(conn, ttl=60)
        registry = _Reads(conn, ttl=60)
        writer.register(_worker("d-0", 9000))
        view = WorkerView(registry, refresh_s=0.05).start()
        try:
            me = threading.current_thread().name
            assert [c.worker_id for c in view.candidates("decode")] == ["d-0"]
            assert registry.readers == [me]  # a pool's first read is the request's own
            writer.register(_worker("d-1", 9001))
            _wait_for(lambda: [c.worker_id for c in view.candidates("decode")] == ["d-0", "d-1"], "d-1 to show")
            writer.register(_worker("d-1", 9001, free=0))  # overloaded: no free blocks
            _wait_for(lambda: [c.free_kv_blocks for c in view.candidates("decode")] == [20, 0], "d-1's overload")
            writer.deregister("d-0", Pool.DECODE)
            _wait_for(lambda: [c.worker_id for c in view.candidates("decode")] == ["d-1"], "d-0 to go")
            assert registry.readers.count(me) == 1 and set(registry.readers[1:]) == {"worker-view"}
            assert view.degraded is None
        finally:
            view.close()
            conn.redis.flushdb()
            conn.close()


def test_a_started_view_never_rereads_on_the_request_path_however_old_its_snapshot():
    """The request thread's clock runs ahead of the refresher's, so the snapshot looks stale to routing
    only: an unstarted view would reread it there (one read per call past ``refresh_s``); a started one
    leaves it to its thread."""
    with LocalRedis() as server:
        conn = connect(server.url, f"t-{uuid.uuid4().hex[:8]}")
        registry = _Reads(conn, ttl=60)
        registry.register(_worker("d-0", 9000))
        ahead = [0.0]
        clock = lambda: ahead[0] if threading.current_thread().name != "worker-view" else 0.0  # noqa: E731
        view = WorkerView(registry, refresh_s=0.2, clock=clock).start()
        try:
            view.candidates("decode")
            for step in range(1, 6):
                ahead[0] = step * 1.0
                assert [c.worker_id for c in view.candidates("decode")] == ["d-0"]
            assert registry.readers == [threading.current_thread().name]  # the first read only
        finally:
            view.close()
        ahead[0] = 10.0
        view.candidates("decode")  # closed: the request path rereads again
        assert len(registry.readers) == 2
        conn.redis.flushdb()
        conn.close()


def test_a_stalled_redis_keeps_the_last_snapshot_degraded_logged_once_and_recovers(caplog):
    caplog.set_level(logging.INFO, logger="controlplane.scheduler.worker_view")
    with LocalRedis() as server:
        conn = connect(server.url, f"t-{uuid.uuid4().hex[:8]}")
        fast = conn.with_budget(0.2)
        WorkerRegistry(conn, ttl=60).register(_worker("d-0", 9000))
        registry = _Reads(fast, ttl=60)
        view = WorkerView(registry, refresh_s=0.05, degraded_retry_s=0.1).start()
        me = threading.current_thread().name
        try:
            assert [c.worker_id for c in view.candidates("decode")] == ["d-0"]
            os.kill(server.pid, signal.SIGSTOP)
            try:
                _wait_for(lambda: view.degraded is not None, "the view to degrade")
                assert "Redis" in view.degraded.reason
                reads = len(registry.readers)
                _wait_for(lambda: len(registry.readers) >= reads + 3, "three more retries")
                for _ in range(50):  # routing keeps the last good snapshot and never waits on Redis itself
                    assert [c.worker_id for c in view.candidates("decode")] == ["d-0"]
                assert registry.readers.count(me) == 1
                with pytest.raises(StateError):  # a pool never read has no snapshot to fall back on
                    view.candidates("prefill")
            finally:
                os.kill(server.pid, signal.SIGCONT)
            _wait_for(lambda: view.degraded is None, "the view to recover")
            assert [c.worker_id for c in view.candidates("decode")] == ["d-0"]
            warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
            assert len(warnings) == 1 and "last good snapshot" in warnings[0].getMessage()
            assert any("answers again" in r.getMessage() for r in caplog.records if r.levelno == logging.INFO)
        finally:
            view.close()
            fast.close()
            conn.redis.flushdb()
            conn.close()


def test_close_leaves_no_thread_behind_even_while_redis_stalls():
    with LocalRedis() as server:
        conn = connect(server.url, f"t-{uuid.uuid4().hex[:8]}")
        fast = conn.with_budget(0.2)
        WorkerRegistry(conn, ttl=60).register(_worker("d-0", 9000))
        before = _threads()
        view = WorkerView(WorkerRegistry(fast, ttl=60), refresh_s=0.05, degraded_retry_s=0.05)
        assert view.start() is view.start()  # idempotent: one thread
        assert len(_threads()) == len(before) + 1
        view.candidates("decode")
        os.kill(server.pid, signal.SIGSTOP)
        try:
            _wait_for(lambda: view.degraded is not None, "a read to stall")
            view.close()
            view.close()
            assert _threads() == before
        finally:
            os.kill(server.pid, signal.SIGCONT)
        # closed, the view still routes: the request path rereads as an unstarted view does
        WorkerRegistry(conn, ttl=60).register(_worker("d-1", 9001))
        _wait_for(lambda: len(view.candidates("decode")) == 2, "an in-line reread")
        assert _threads() == before
        fast.close()
        conn.redis.flushdb()
        conn.close()


class _SlowReads(_Reads):
    """The real registry, each read held for ``delay_s`` (a pool of many workers, or a busy Redis)."""

    def __init__(self, *args, delay_s: float = 0.2, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.delay_s = delay_s

    def live_workers(self, pool):
        time.sleep(self.delay_s)
        return super().live_workers(pool)


@pytest.mark.parametrize("started", [True, False])
def test_requests_waiting_for_room_reread_redis_once_not_each(started: bool):
    """Every request waiting for decode room invalidates the view after each backoff. Hundreds of them at
    once each reread the pool (more connections than the client's pool holds: "Too many connections", a 503)
    when invalidating dropped the snapshot; now one thread rereads and the rest route on the old rows. The
    same for a pool's first read: one reads, the others wait for it."""
    with LocalRedis() as server:
        conn = connect(server.url, f"t-{uuid.uuid4().hex[:8]}")
        WorkerRegistry(conn, ttl=60).register(_worker("d-0", 9000))
        registry = _SlowReads(conn, ttl=60)
        view = WorkerView(registry, refresh_s=3600.0)  # the refresher (when started) never finds it due
        if started:
            view.start()
        seen: list[list[str]] = []
        errors: list[BaseException] = []

        def route() -> None:
            try:
                seen.append([c.worker_id for c in view.candidates("decode")])
            except BaseException as exc:  # noqa: BLE001  # every thread's outcome is checked below
                errors.append(exc)

        try:
            for round_ in range(2):  # the first read, then a read after invalidate
                if round_:
                    view.invalidate()
                before = len(registry.readers)
                threads = [threading.Thread(target=route) for _ in range(32)]
                for t in threads:
                    t.start()
                for t in threads:
                    t.join(timeout=30)
                assert not errors and seen == [["d-0"]] * 32 * (round_ + 1)
                assert len(registry.readers) - before == 1, registry.readers[before:]
        finally:
            view.close()
            conn.redis.flushdb()
            conn.close()


class _Failing(_SlowReads):
    """Reads held for ``delay_s``; while ``failing``, each fails as a Redis that does not answer would."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.failing = False

    def live_workers(self, pool):
        if self.failing:
            self.readers.append(threading.current_thread().name)
            time.sleep(self.delay_s)
            raise StateError("redis://127.0.0.1:1", "Timeout reading from socket")
        return super().live_workers(pool)


def test_a_first_read_that_fails_fails_its_waiters_too_not_one_after_another():
    """Threads waiting on a pool's first read share its failure (Redis away: every request is told at
    once), rather than each retrying in turn (the last of N waited N command budgets)."""
    with LocalRedis() as server:
        conn = connect(server.url, f"t-{uuid.uuid4().hex[:8]}")
        registry = _Failing(conn, ttl=60, delay_s=0.3)
        registry.failing = True
        view = WorkerView(registry, refresh_s=3600.0, degraded_retry_s=60.0)
        errors: list[BaseException] = []

        def route() -> None:
            try:
                view.candidates("decode")
            except BaseException as exc:  # noqa: BLE001  # every thread's outcome is checked below
                errors.append(exc)
        try:
            threads = [threading.Thread(target=route) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=30)
            assert len(errors) == 8 and all(isinstance(e, StateError) for e in errors)
            assert len(registry.readers) == 1, registry.readers
        finally:
            conn.close()


def test_while_degraded_an_invalidated_snapshot_is_reread_at_the_retry_pace_not_by_every_request():
    """Requests waiting for room invalidate the view after each backoff; with Redis stalled, each would
    otherwise reread (and wait out the command budget) in turn, forever."""
    clock = [100.0]
    with LocalRedis() as server:
        conn = connect(server.url, f"t-{uuid.uuid4().hex[:8]}")
        WorkerRegistry(conn, ttl=60).register(_worker("d-0", 9000))
        registry = _Failing(conn, ttl=60, delay_s=0.0)
        view = WorkerView(registry, refresh_s=0.2, degraded_retry_s=1.0, clock=lambda: clock[0])
        try:
            assert [c.worker_id for c in view.candidates("decode")] == ["d-0"]
            registry.failing = True
            reads = len(registry.readers)
            view.invalidate()
            for _ in range(5):  # the first rereads and fails; the view degrades and keeps its rows
                assert [c.worker_id for c in view.candidates("decode")] == ["d-0"]
                view.invalidate()  # as each waiting request does after its backoff
            assert view.degraded is not None and len(registry.readers) - reads == 1
            clock[0] += 1.5  # past the retry interval: one more try
            view.candidates("decode")
            assert len(registry.readers) - reads == 2
        finally:
            conn.redis.flushdb()
            conn.close()
