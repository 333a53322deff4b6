"""epd serve's own redis-server is restarted on its port when it dies, and the pool targets come back."""

from __future__ import annotations

import os
import signal
import time

import pytest

from controlplane.state import LocalRedis, Pool, PoolTargets, connect
from controlplane.state.watchdog import PrivateRedisWatchdog

pytestmark = [pytest.mark.integration]


def test_a_killed_private_redis_is_restarted_on_its_port_and_targets_are_written_again():
    redis = LocalRedis(password="watchdog-pw-0123").start()  # as epd serve starts it
    url, first_pid = redis.url, redis.pid
    conn = connect(url, "watchdog", retries=1, socket_timeout=1.0)
    rewritten: list[int] = []

    def on_restart() -> None:  # what serve does: the targets of the replicas it runs
        PoolTargets(conn).set_target(Pool.DECODE, 2)
        rewritten.append(1)

    watchdog = PrivateRedisWatchdog(redis, on_restart, interval_s=0.1).start()
    try:
        PoolTargets(conn).set_target(Pool.DECODE, 2)
        os.kill(first_pid, signal.SIGKILL)  # the server this test started
        deadline = time.monotonic() + 15
        while not rewritten and time.monotonic() < deadline:
            time.sleep(0.05)
        assert rewritten and watchdog.restarts == 1
        assert watchdog.redis.url == url and watchdog.redis.pid != first_pid  # the same password too
        assert PoolTargets(conn).get_target(Pool.DECODE) == 2  # the same client, reconnected
    finally:
        watchdog.close()
        conn.close()
    assert not watchdog.redis.running  # close() stops the server it restarted
