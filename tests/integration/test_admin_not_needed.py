"""A pool the model does not need, over a real Redis: /admin/pools and the dashboard's data say so with the
reason, `epd status` prints it, and scaling it is refused with that reason, writing nothing."""

from __future__ import annotations

import pytest
from fastapi import FastAPI
from fastapi.testclient import TestClient

from controlplane.admin import admin_router, pools_status
from controlplane.admin_client import format_status
from controlplane.api.dashboard import dashboard_state
from controlplane.api.errors import install_error_handlers
from controlplane.state import PoolTargets, WorkerRegistry

from redis_fixture import redis_server, state_conn  # noqa: F401 - fixtures

pytestmark = [pytest.mark.integration]
TOKEN = "admin-" + "y" * 24
AUTH = {"Authorization": f"Bearer {TOKEN}"}
WHY = "not needed: the model tiny is text-only (it has no vision tower), so nothing is encoded"


def test_a_text_only_models_encode_pool_is_shown_as_not_needed_and_not_scaled(state_conn):  # noqa: F811
    registry = WorkerRegistry(state_conn, ttl=30)
    PoolTargets(state_conn).set_target("encode", 0)
    app = FastAPI()
    install_error_handlers(app)
    app.include_router(admin_router(state_conn, registry, TOKEN, fixed_pools={"encode": WHY}))
    client = TestClient(app)
    try:
        pools = {p["pool"]: p for p in client.get("/admin/pools", headers=AUTH).json()["pools"]}
        assert pools["encode"]["not_needed"] == WHY and pools["encode"]["target"] == 0
        assert pools["prefill"]["not_needed"] is None and pools["decode"]["not_needed"] is None
        text = format_status({"pools": list(pools.values())})
        assert f"encode         -      -  {WHY}" in text.splitlines()
        reply = client.put("/admin/pools/encode", json={"replicas": 2}, headers=AUTH)
        assert reply.status_code == 409 and "text-only" in reply.text
        assert PoolTargets(state_conn).get_target("encode") == 0  # nothing written
        state = dashboard_state(lambda: pools_status(state_conn, registry, None, {"encode": WHY}), None)
        assert {p["pool"]: p["not_needed"] for p in state["pools"]} == {"encode": WHY, "prefill": None,
                                                                       "decode": None}
    finally:
        PoolTargets(state_conn).clear_target("encode")
