"""Counters for status and the dashboard: atomic integer increments (INCRBY), no TTL.

A retried increment whose reply was lost may count twice; these are operational statistics, not ledgers.
"""

from __future__ import annotations

from controlplane.state.client import StateConnection


class Counters:
    """Named integer counters. Names follow the key rules (no ':' or whitespace)."""

    def __init__(self, conn: StateConnection) -> None:
        self._conn = conn
        self._keys = conn.keys

    def incr(self, name: str, by: int = 1) -> int:
        """Add ``by`` (may be negative) to ``name`` atomically; returns the new value."""
        if isinstance(by, bool) or not isinstance(by, int):
            raise ValueError(f"counter increment must be an integer, got {by!r}")
        key = self._keys.counter(name)
        with self._conn.guard():
            pipe = self._conn.redis.pipeline(transaction=True)
            pipe.incrby(key, by)
            pipe.sadd(self._keys.counters(), name)
            value, _ = pipe.execute()
        return int(value)

    def get(self, name: str) -> int:
        """Current value; 0 for a counter never incremented."""
        with self._conn.guard():
            value = self._conn.redis.get(self._keys.counter(name))
        return 0 if value is None else int(value)

    def get_all(self) -> dict[str, int]:
        """Every counter, by name (sorted)."""
        with self._conn.guard():
            names = sorted(self._conn.redis.smembers(self._keys.counters()))
            values = self._conn.redis.mget([self._keys.counter(n) for n in names]) if names else []
        return {name: int(v) for name, v in zip(names, values) if v is not None}

    def reset(self, name: str) -> None:
        """Delete one counter."""
        with self._conn.guard():
            pipe = self._conn.redis.pipeline(transaction=True)
            pipe.delete(self._keys.counter(name))
            pipe.srem(self._keys.counters(), name)
            pipe.execute()

    def reset_all(self) -> None:
        """Delete every counter. A counter first incremented meanwhile survives, still indexed."""
        with self._conn.guard():
            names = self._conn.redis.smembers(self._keys.counters())
            if not names:
                return
            pipe = self._conn.redis.pipeline(transaction=True)
            for name in names:
                pipe.delete(self._keys.counter(name))
            pipe.srem(self._keys.counters(), *names)
            pipe.execute()
