"""Worker registry: who serves each pool, where, how loaded, and whether its lease is alive.

Lease lifecycle of one worker:

1. ``register(info)``: writes the worker's hash and adds it to its pool's index with lease end
   ``now + ttl`` (the registry's clock). Replaces any earlier record of the same worker.
2. ``heartbeat(worker_id, pool, load)`` every ``ttl / 3`` or so: new load, lease end ``now + ttl``.
   A heartbeat for a worker whose hash is gone raises ``WorkerNotRegistered``: register again.
3. ``set_draining`` (control plane): the worker stays registered, routing skips it for new work.
4. ``deregister``, or silence. A silent worker leaves ``live_workers`` once its lease end passes (one
   TTL, by the reader's clock), and Redis deletes its hash after two TTLs (PEXPIRE, Redis's clock), so it
   is gone within two TTLs even if the clocks disagree or nobody reads.

Registration and heartbeats are Lua scripts, so a heartbeat can never recreate a hash that expired.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field, fields

from redis import exceptions as redis_errors

from controlplane.state.client import StateConnection
from controlplane.state.clock import Clock, SystemClock
from controlplane.state.errors import WorkerNotRegistered
from controlplane.state.keys import Pool, parse_pool, validate_id

DEFAULT_TTL = 5.0

# KEYS: worker hash, pool index. ARGV: mode, hard TTL (ms), lease end, worker id, field/value pairs...
_LEASE = """
if ARGV[1] == 'register' then
  redis.call('DEL', KEYS[1])
elseif redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
redis.call('HSET', KEYS[1], unpack(ARGV, 5))
redis.call('PEXPIRE', KEYS[1], ARGV[2])
redis.call('ZADD', KEYS[2], ARGV[3], ARGV[4])
if redis.call('PTTL', KEYS[2]) < tonumber(ARGV[2]) then
  redis.call('PEXPIRE', KEYS[2], ARGV[2])
end
return 1
"""
# KEYS: worker hash. ARGV: field, value. Updates a live worker without touching its lease.
_UPDATE_IF_EXISTS = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
return 1
"""
# KEYS: pool index, worker hash. ARGV: worker id. Drops an index entry whose hash has expired.
_PRUNE = """
if redis.call('EXISTS', KEYS[2]) == 0 then return redis.call('ZREM', KEYS[1], ARGV[1]) end
return 0
"""


def _count(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"{name} must be a non-negative integer, got {value!r}")


@dataclass(frozen=True)
class WorkerLoad:
    """What a worker reports each heartbeat. Tokens and KV blocks are counts; ``running`` is requests;
    ``preemptions``: sequences its engine preempted since it started; ``prefix_cache_queries``: prompt tokens its
    engine looked up in its prefix cache since it started, ``prefix_cache_hits`` those found (counters)."""

    queued_tokens: int = 0
    free_kv_blocks: int = 0
    total_kv_blocks: int = 0
    running: int = 0
    preemptions: int = 0
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0

    def __post_init__(self) -> None:
        for f in fields(self):
            _count(f.name, getattr(self, f.name))
        if self.free_kv_blocks > self.total_kv_blocks:
            raise ValueError(f"free_kv_blocks ({self.free_kv_blocks}) exceeds total_kv_blocks "
                             f"({self.total_kv_blocks})")


@dataclass(frozen=True)
class WorkerInfo:
    """A worker as registered: identity, its gRPC ``host:port``, what it serves, and its load. ``version``: the
    code it runs (``controlplane.code_version``). ``pid``: its process id on that host (0: not said, by a
    worker from before it was registered)."""

    worker_id: str
    pool: Pool
    address: str
    model_fingerprint: str = ""
    version: str = ""
    load: WorkerLoad = field(default_factory=WorkerLoad)
    draining: bool = False
    pid: int = 0

    def __post_init__(self) -> None:
        validate_id("worker id", self.worker_id)
        object.__setattr__(self, "pool", parse_pool(self.pool))
        host, sep, port = self.address.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"address must be host:port with a port in 1..65535, got {self.address!r}")


@dataclass(frozen=True)
class WorkerRecord:
    """A registered worker and its lease, in seconds of the registry's clock."""

    info: WorkerInfo
    heartbeat_at: float
    lease_expires_at: float


def _load_fields(load: WorkerLoad) -> dict[str, str]:
    return {f.name: str(getattr(load, f.name)) for f in fields(load)}


def _decode(raw: dict[str, str]) -> WorkerRecord:
    # a field a worker of older code does not write reads as 0 (its hash lives until that worker stops)
    load = WorkerLoad(**{f.name: int(raw.get(f.name, "0")) for f in fields(WorkerLoad)})
    info = WorkerInfo(worker_id=raw["worker_id"], pool=Pool(raw["pool"]), address=raw["address"],
                      model_fingerprint=raw["model_fingerprint"], version=raw["version"], load=load,
                      draining=raw["draining"] == "1", pid=int(raw.get("pid", "0")))
    return WorkerRecord(info=info, heartbeat_at=float(raw["heartbeat_at"]),
                        lease_expires_at=float(raw["lease_expires_at"]))


class WorkerRegistry:
    """Leases of workers in Redis. ``ttl`` is the lease in seconds; ``clock`` dates leases."""

    def __init__(self, conn: StateConnection, *, clock: Clock | None = None, ttl: float = DEFAULT_TTL) -> None:
        if not (math.isfinite(ttl) and ttl >= 0.001):
            raise ValueError(f"ttl must be at least 0.001 s, got {ttl!r}")
        self._conn = conn
        self._keys = conn.keys
        self._clock: Clock = clock if clock is not None else SystemClock()
        self.ttl = ttl
        self._hard_ttl_ms = math.ceil(2 * ttl * 1000)
        self._lease = conn.redis.register_script(_LEASE)
        self._update = conn.redis.register_script(_UPDATE_IF_EXISTS)
        self._prune = conn.redis.register_script(_PRUNE)

    def _write_lease(self, mode: str, worker_id: str, pool: Pool, values: dict[str, str]) -> float:
        now = self._clock.now()
        expires = now + self.ttl
        values = {**values, "heartbeat_at": repr(now), "lease_expires_at": repr(expires)}
        flat = [item for pair in values.items() for item in pair]
        keys = [self._keys.worker(pool, worker_id), self._keys.workers(pool)]
        with self._conn.guard():
            ok = self._lease(keys=keys, args=[mode, self._hard_ttl_ms, repr(expires), worker_id, *flat])
        if not ok:
            raise WorkerNotRegistered(f"{pool.value} worker {worker_id!r} has no live lease; register it again")
        return expires

    def register(self, info: WorkerInfo) -> float:
        """Write ``info`` and start its lease; returns the lease end (seconds, registry clock)."""
        values = {"worker_id": info.worker_id, "pool": info.pool.value, "address": info.address,
                  "model_fingerprint": info.model_fingerprint, "version": info.version,
                  "draining": "1" if info.draining else "0", "pid": str(info.pid), **_load_fields(info.load)}
        return self._write_lease("register", info.worker_id, info.pool, values)

    def heartbeat(self, worker_id: str, pool: Pool | str, load: WorkerLoad) -> float:
        """Report ``load`` and extend the lease; returns the new lease end. ``WorkerNotRegistered`` if gone."""
        return self._write_lease("heartbeat", worker_id, parse_pool(pool), _load_fields(load))

    def set_draining(self, worker_id: str, pool: Pool | str, draining: bool = True) -> None:
        """Mark a worker as draining (no new work) or not; the lease is untouched."""
        pool = parse_pool(pool)
        with self._conn.guard():
            ok = self._update(keys=[self._keys.worker(pool, worker_id)], args=["draining", "1" if draining else "0"])
        if not ok:
            raise WorkerNotRegistered(f"{pool.value} worker {worker_id!r} is not registered")

    def deregister(self, worker_id: str, pool: Pool | str) -> bool:
        """Remove a worker now; returns whether it was registered. Idempotent."""
        pool = parse_pool(pool)
        with self._conn.guard():
            pipe = self._conn.redis.pipeline(transaction=True)
            pipe.delete(self._keys.worker(pool, worker_id))
            pipe.zrem(self._keys.workers(pool), worker_id)
            deleted, _ = pipe.execute()
        return bool(deleted)

    def get(self, worker_id: str, pool: Pool | str) -> WorkerRecord | None:
        """The worker's record if its lease is alive, else None."""
        pool = parse_pool(pool)
        with self._conn.guard():
            raw = self._conn.redis.hgetall(self._keys.worker(pool, worker_id))
        if not raw:
            return None
        record = _decode(raw)
        return record if record.lease_expires_at > self._clock.now() else None

    def find(self, worker_id: str) -> WorkerRecord | None:
        """The live worker with this id in any pool (the CLI names workers by id alone)."""
        return next((r for pool in Pool if (r := self.get(worker_id, pool)) is not None), None)

    def live_workers(self, pool: Pool | str) -> list[WorkerRecord]:
        """Workers of ``pool`` whose lease is alive, by worker id. Prunes expired entries from the index."""
        pool = parse_pool(pool)
        index = self._keys.workers(pool)
        now = self._clock.now()
        with self._conn.guard():
            # A read first, the pruning after and apart from it: a Redis that refuses writes (out of memory,
            # a read-only replica) still lists the live workers.
            members = self._conn.redis.zrangebyscore(index, f"({now!r}", "+inf")
            with contextlib.suppress(redis_errors.OutOfMemoryError, redis_errors.ReadOnlyError):
                self._conn.redis.zremrangebyscore(index, "-inf", repr(now))
            pipe = self._conn.redis.pipeline(transaction=False)
            for worker_id in members:
                pipe.hgetall(self._keys.worker(pool, worker_id))
            hashes = pipe.execute()
            records = []
            for worker_id, raw in zip(members, hashes):
                if raw:
                    records.append(_decode(raw))
                else:  # Redis expired the hash first (clocks disagree): drop the stale index entry
                    with contextlib.suppress(redis_errors.OutOfMemoryError, redis_errors.ReadOnlyError):
                        self._prune(keys=[index, self._keys.worker(pool, worker_id)], args=[worker_id])
        return sorted((r for r in records if r.lease_expires_at > now), key=lambda r: r.info.worker_id)
