"""The admin API over a real Redis: status, scaling targets, draining and its undo, and the admin token."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from controlplane.admin import admin_router
from controlplane.api.errors import install_error_handlers
from controlplane.code_version import code_version
from controlplane.state import PoolTargets, WorkerRegistry
from controlplane.state.keys import Pool
from controlplane.state.registry import WorkerInfo, WorkerLoad

from redis_fixture import redis_server, state_conn  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration]
TOKEN = "admin-" + "x" * 24


@pytest.fixture
def admin(state_conn):  # noqa: F811
    registry = WorkerRegistry(state_conn, ttl=30)
    drained: list[str] = []

    def drain(worker_id: str) -> bool:
        drained.append(worker_id)
        return True

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_router(state_conn, registry, TOKEN, on_drain=drain))
    registry.register(WorkerInfo("decode-a", Pool.DECODE, "127.0.0.1:5001",
                                 load=WorkerLoad(free_kv_blocks=10, total_kv_blocks=16, running=2, preemptions=5,
                                                 prefix_cache_queries=400, prefix_cache_hits=96),
                                 pid=4242, version="0.1.0+0123456789ab"))
    registry.register(WorkerInfo("prefill-a", Pool.PREFILL, "127.0.0.1:5002"))
    yield TestClient(app), registry, drained, state_conn
    for wid, pool in (("decode-a", "decode"), ("prefill-a", "prefill")):
        registry.deregister(wid, pool)
    for pool in ("encode", "prefill", "decode"):
        PoolTargets(state_conn).clear_target(pool)


AUTH = {"Authorization": f"Bearer {TOKEN}"}


def test_status_lists_every_pool_with_targets_and_load(admin):
    client, registry, _, conn = admin
    PoolTargets(conn).set_target("decode", 1)
    reply = client.get("/admin/pools", headers=AUTH).json()
    assert reply["version"] == code_version()  # the API's own code, beside each worker's
    pools = {p["pool"]: p for p in reply["pools"]}
    assert set(pools) == {"encode", "prefill", "decode"}
    assert pools["decode"]["target"] == 1 and pools["decode"]["ready"] == 1
    assert pools["decode"]["workers"][0] | {} == {"worker_id": "decode-a", "address": "127.0.0.1:5001",
                                                  "draining": False, "running": 2, "queued_tokens": 0,
                                                  "free_kv_blocks": 10, "total_kv_blocks": 16, "pid": 4242,
                                                  "version": "0.1.0+0123456789ab", "preemptions": 5,
                                                  "prefix_cache_queries": 400, "prefix_cache_hits": 96}
    assert pools["encode"]["target"] is None and pools["encode"]["workers"] == []


def test_scaling_writes_only_that_pools_target(admin):
    client, _, _, conn = admin
    PoolTargets(conn).set_target("prefill", 1)
    reply = client.put("/admin/pools/decode", json={"replicas": 3}, headers=AUTH)
    assert reply.status_code == 200 and reply.json() == {"pool": "decode", "target": 3}
    targets = PoolTargets(conn)
    assert (targets.get_target("decode"), targets.get_target("prefill")) == (3, 1)
    for body, status in (({"replicas": -1}, 400), ({"replicas": "two"}, 400), ({"replicaz": 2}, 400),
                         ({"replicas": 1001}, 400), ({"replicas": "2"}, 400), ({"replicas": 2.0}, 400),
                         ({"replicas": True}, 400), ([2], 400)):
        bad = client.put("/admin/pools/decode", json=body, headers=AUTH)
        assert bad.status_code == status and "error" in bad.json(), (body, bad.text)
    bad = client.put("/admin/pools/decode", json={"replicas": "2"}, headers=AUTH).json()["error"]
    assert bad["param"] == "replicas" and "valid integer" in bad["message"], bad
    for raw in (b"", b"{not json"):
        bad = client.put("/admin/pools/decode", content=raw, headers=AUTH | {"content-type": "application/json"})
        assert bad.status_code == 400 and ("missing" in bad.text or "parse the JSON" in bad.text), bad.text
    assert client.put("/admin/pools/gpu", json={"replicas": 1}, headers=AUTH).status_code == 404
    assert targets.get_target("decode") == 3  # the refused changes changed nothing


def test_drain_marks_the_worker_and_stops_routing_to_it(admin):
    client, registry, drained, _ = admin
    reply = client.post("/admin/workers/decode-a/drain", headers=AUTH)
    assert reply.status_code == 200 and reply.json()["draining"] is True
    assert registry.get("decode-a", "decode").info.draining is True and drained == ["decode-a"]
    pools = {p["pool"]: p for p in client.get("/admin/pools", headers=AUTH).json()["pools"]}
    assert pools["decode"]["ready"] == 0
    assert client.post("/admin/workers/nobody/drain", headers=AUTH).status_code == 404
    for bad in ("a:b", "a%20b", "x" * 300):  # ids no worker can have: 404 too, not a 500
        for method in (client.post, client.delete):
            reply = method(f"/admin/workers/{bad}/drain", headers=AUTH)
            assert reply.status_code == 404 and "no live worker" in reply.json()["error"]["message"], reply.text


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": TOKEN}])
def test_every_admin_route_needs_the_token(admin, headers):
    client, registry, drained, conn = admin
    reply = client.get("/admin/pools", headers=headers)
    assert reply.status_code == 401 and reply.headers["www-authenticate"] == "Bearer"
    assert client.put("/admin/pools/decode", json={"replicas": 5}, headers=headers).status_code == 401
    # the token is checked before the body: a caller without it learns nothing about what the body holds
    for raw in (b'{"replicas": "x"}', b"", b"{not json", b"[1]"):
        reply = client.put("/admin/pools/decode", content=raw, headers=headers | {"content-type": "application/json"})
        assert reply.status_code == 401 and "admin token" in reply.json()["error"]["message"], (raw, reply.text)
    assert client.post("/admin/workers/decode-a/drain", headers=headers).status_code == 401
    assert PoolTargets(conn).get_target("decode") is None and drained == []
    assert registry.get("decode-a", "decode").info.draining is False
    registry.set_draining("decode-a", "decode")
    assert client.delete("/admin/workers/decode-a/drain", headers=headers).status_code == 401
    assert registry.get("decode-a", "decode").info.draining is True


class _Manager:
    """What the pool manager tells the admin API: here, only which workers a scale-down is stopping."""

    def __init__(self) -> None:
        self.stopping_ids: set[str] = set()

    def pending(self, pool: str) -> tuple:
        return ()

    def problem(self, pool: str) -> str | None:
        return None

    def stopping(self, worker_id: str) -> bool:
        return worker_id in self.stopping_ids


@pytest.fixture
def resumable(state_conn):  # noqa: F811
    """An admin API whose Resume calls are recorded and answered with ``answers`` (None: the worker resumed)."""
    registry = WorkerRegistry(state_conn, ttl=30)
    calls: list[str] = []
    answers: dict[str, str] = {}
    manager = _Manager()

    def resume(worker_id: str) -> str | None:
        calls.append(worker_id)
        return answers.get(worker_id)

    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_router(state_conn, registry, TOKEN, on_resume=resume, starts=manager))
    for wid in ("decode-a", "decode-b"):
        registry.register(WorkerInfo(wid, Pool.DECODE, "127.0.0.1:5001", draining=True))
    yield TestClient(app), registry, calls, answers, manager
    for wid in ("decode-a", "decode-b"):
        registry.deregister(wid, "decode")


def test_undoing_a_drain_puts_the_worker_back_in_routing(resumable):
    client, registry, calls, _, _ = resumable
    reply = client.delete("/admin/workers/decode-a/drain", headers=AUTH)
    assert reply.status_code == 200 and reply.json() == {"worker_id": "decode-a", "draining": False}
    assert calls == ["decode-a"]
    assert registry.get("decode-a", "decode").info.draining is False
    assert registry.get("decode-b", "decode").info.draining is True  # only that worker
    pools = {p["pool"]: p for p in client.get("/admin/pools", headers=AUTH).json()["pools"]}
    assert pools["decode"]["ready"] == 1
    assert client.delete("/admin/workers/nobody/drain", headers=AUTH).status_code == 404


def test_a_worker_that_does_not_resume_stays_out_of_routing(resumable):
    """The worker is told first: routing must not send work to a worker that still refuses it."""
    client, registry, calls, answers, _ = resumable
    answers["decode-a"] = "UNAVAILABLE: failed to connect"
    reply = client.delete("/admin/workers/decode-a/drain", headers=AUTH)
    assert reply.status_code == 502, reply.text
    assert "did not resume (UNAVAILABLE: failed to connect); routing still skips it" in reply.json()["error"]["message"]
    assert calls == ["decode-a"] and registry.get("decode-a", "decode").info.draining is True


def test_a_scale_down_that_chooses_the_worker_while_it_resumes_wins(resumable):
    """The scale-down picked the worker between the check and the registry write: it drains again (409)."""
    client, registry, calls, _, manager = resumable
    checks: list[str] = []

    def stopping(worker_id: str) -> bool:  # false at the first check; the reconcile chooses it right after
        checks.append(worker_id)
        return len(checks) > 1
    manager.stopping = stopping
    reply = client.delete("/admin/workers/decode-a/drain", headers=AUTH)
    assert reply.status_code == 409 and "being stopped by a scale-down" in reply.text
    assert calls == ["decode-a"] and checks == ["decode-a", "decode-a"]
    assert registry.get("decode-a", "decode").info.draining is True


def test_a_worker_a_scale_down_is_stopping_is_not_resumed(resumable):
    client, registry, calls, _, manager = resumable
    manager.stopping_ids.add("decode-b")
    reply = client.delete("/admin/workers/decode-b/drain", headers=AUTH)
    assert reply.status_code == 409 and "being stopped by a scale-down of the decode pool" in reply.text
    assert calls == [] and registry.get("decode-b", "decode").info.draining is True


def test_redis_away_is_a_503_that_says_so_on_every_route():
    """Not a generic 500: `epd status` and `epd scale` print this message."""
    from controlplane.state import LocalRedis, connect
    down = LocalRedis()
    down.start()
    conn = connect(down.url, "admin-down", retries=0, socket_timeout=0.5)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_router(conn, WorkerRegistry(conn, ttl=30), TOKEN))
    client = TestClient(app)
    down.close()  # Redis goes away under a running API
    try:
        for method, path, body in (("GET", "/admin/pools", None), ("PUT", "/admin/pools/decode", {"replicas": 2}),
                                   ("POST", "/admin/workers/decode-a/drain", None),
                                   ("DELETE", "/admin/workers/decode-a/drain", None)):
            reply = client.request(method, path, json=body, headers=AUTH)
            assert reply.status_code == 503, (path, reply.text)
            assert "Redis" in reply.json()["error"]["message"] and reply.headers["retry-after"] == "1"
    finally:
        conn.close()


def test_a_pool_fixed_by_the_mode_is_not_scaled(state_conn):  # noqa: F811
    registry = WorkerRegistry(state_conn, ttl=30)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_router(state_conn, registry, TOKEN,
                                    fixed_pools={"prefill": "colocated mode has no prefill pool"}))
    client = TestClient(app)
    reply = client.put("/admin/pools/prefill", json={"replicas": 2}, headers=AUTH)
    assert reply.status_code == 409 and "colocated mode has no prefill pool" in reply.text
    assert PoolTargets(state_conn).get_target("prefill") is None  # nothing written
    assert client.put("/admin/pools/decode", json={"replicas": 2}, headers=AUTH).status_code == 200
    PoolTargets(state_conn).clear_target("decode")
