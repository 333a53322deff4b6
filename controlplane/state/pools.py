"""Pool targets: the replica count the operator wants for each pool. Desired state, so no TTL.

A target changes by ``epd scale`` (the admin API), or by a configured count that differs from the one last
applied: the settings' when a pool manager starts, or the replicas file's while it serves
(controlplane/replicas_file.py); ``apply_configured`` decides which."""

from __future__ import annotations

import redis

from controlplane.state.client import StateConnection
from controlplane.state.keys import Pool, parse_pool

MAX_REPLICAS = 1000


def validate_replicas(replicas: int) -> int:
    """``replicas`` if it is an integer in 0..MAX_REPLICAS; ``ValueError`` otherwise."""
    if isinstance(replicas, bool) or not isinstance(replicas, int):
        raise ValueError(f"replicas must be an integer, got {replicas!r}")
    if not 0 <= replicas <= MAX_REPLICAS:
        raise ValueError(f"replicas must be between 0 and {MAX_REPLICAS}, got {replicas}")
    return replicas


class PoolTargets:
    """Desired replicas per pool, read by the autoscaling loop and ``epd status``."""

    def __init__(self, conn: StateConnection) -> None:
        self._conn = conn
        self._keys = conn.keys

    def set_target(self, pool: Pool | str, replicas: int) -> None:
        """Set the desired replica count of ``pool`` (0..1000)."""
        key = self._keys.pool_target(pool)
        validate_replicas(replicas)
        with self._conn.guard():
            self._conn.redis.set(key, str(replicas))

    def get_target(self, pool: Pool | str) -> int | None:
        """The desired replica count, or None if none was ever set."""
        with self._conn.guard():
            value = self._conn.redis.get(self._keys.pool_target(pool))
        return None if value is None else int(value)

    def all_targets(self) -> dict[Pool, int]:
        """Targets of the pools that have one, in pool order (encode, prefill, decode)."""
        pools = list(Pool)
        with self._conn.guard():
            values = self._conn.redis.mget([self._keys.pool_target(p) for p in pools])
        return {pool: int(v) for pool, v in zip(pools, values) if v is not None}

    def clear_target(self, pool: Pool | str) -> bool:
        """Forget the target of ``pool`` (and what the settings asked); returns whether a target was set."""
        pool = parse_pool(pool)
        with self._conn.guard():
            removed = self._conn.redis.delete(self._keys.pool_target(pool))
            self._conn.redis.delete(self._keys.pool_configured(pool))
        return bool(removed)

    def apply_configured(self, pool: Pool | str, replicas: int) -> int:
        """The target to use given ``replicas`` configured (the settings at a pool manager's start, or the
        replicas file): the most recent intent wins. The configured count when it changed since the last one
        applied (or none was); otherwise the target already in Redis, so an ``epd scale`` survives a
        control-plane restart and a replicas file whose count did not change. Returns the target now in effect."""
        pool = parse_pool(pool)
        validate_replicas(replicas)
        target_key, configured_key = self._keys.pool_target(pool), self._keys.pool_configured(pool)
        with self._conn.guard():
            with self._conn.redis.pipeline(transaction=True) as pipe:
                while True:
                    try:
                        pipe.watch(target_key, configured_key)
                        target, configured = pipe.mget(target_key, configured_key)
                        keep = target is not None and configured is not None and int(configured) == replicas
                        effective = int(target) if keep else replicas
                        pipe.multi()
                        pipe.set(target_key, str(effective))
                        pipe.set(configured_key, str(replicas))
                        pipe.execute()
                        return effective
                    except redis.WatchError:
                        continue  # someone scaled at the same moment: read again
