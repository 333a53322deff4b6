"""A real redis-server for integration tests, and a per-test connection under a unique key prefix.

Import the fixtures into a test module: ``from redis_fixture import redis_server, state_conn``.
``state_conn`` fails the test if any key under its prefix is left behind.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Iterator

import pytest

from controlplane.state import LocalRedis, StateConnection, connect


def process_gone(pid: int) -> bool:
    """Whether no process has this id (the server was stopped and reaped)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def keys_under(conn: StateConnection) -> list[str]:
    """Every key under the connection's prefix, sorted."""
    return sorted(conn.redis.scan_iter(match=conn.keys.pattern, count=1000))


@pytest.fixture(scope="module")
def redis_server() -> Iterator[LocalRedis]:
    server = LocalRedis().start()
    pid = server.pid
    yield server
    server.close()
    assert not server.running
    assert process_gone(pid), f"redis-server {pid} still running after close()"


@pytest.fixture
def state_conn(redis_server: LocalRedis) -> Iterator[StateConnection]:
    conn = connect(redis_server.url, f"t-{uuid.uuid4().hex[:12]}")
    yield conn
    leftover = keys_under(conn)
    conn.close()
    assert leftover == [], f"keys left under {conn.keys.prefix}: {leftover}"
