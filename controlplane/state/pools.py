"""Pool targets: the replica count the operator wants for each pool. Desired state, so no TTL."""

from __future__ import annotations

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
        """Forget the target of ``pool``; returns whether one was set."""
        with self._conn.guard():
            return bool(self._conn.redis.delete(self._keys.pool_target(parse_pool(pool))))
