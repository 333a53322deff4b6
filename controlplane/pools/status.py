"""Typed values the pool manager hands out: what a pool looks like now, and why a change failed."""

from __future__ import annotations

from dataclasses import dataclass

from controlplane.state import Pool, WorkerLoad, WorkerRecord


class PoolError(Exception):
    """A pool could not be brought to its target."""


class RayJoinError(PoolError):
    """The Ray cluster at ``ray.address`` could not be joined (unreachable, or it refused this process's
    token); the message names the address and this process's Ray auth mode."""


class WorkerStartError(PoolError):
    """A replica did not come up: its actor raised (the text is in the message), or it timed out."""


@dataclass(frozen=True)
class ReplicaStatus:
    """One live worker as the registry sees it. Times are seconds of the registry's clock."""

    worker_id: str
    address: str
    draining: bool
    load: WorkerLoad
    heartbeat_at: float
    lease_expires_at: float
    managed: bool  # whether this manager started (and will stop) its actor

    @classmethod
    def from_record(cls, record: WorkerRecord, managed: bool) -> ReplicaStatus:
        info = record.info
        return cls(info.worker_id, info.address, info.draining, info.load, record.heartbeat_at,
                   record.lease_expires_at, managed)


@dataclass(frozen=True)
class PoolStatus:
    """A pool's desired size (None: no target set) and its workers with a live lease, by worker id."""

    pool: Pool
    target: int | None
    managed: int  # actors this manager holds for the pool, draining ones included
    replicas: tuple[ReplicaStatus, ...]

    @property
    def ready(self) -> int:
        """Live replicas that take new work."""
        return sum(1 for r in self.replicas if not r.draining)


@dataclass(frozen=True)
class PendingReplica:
    """A replica asked of Ray that is not serving yet, and why. ``waiting_s``: seconds since it was asked for.
    ``needs``: the Ray resources it asked for (name -> amount). ``placed``: False while Ray cannot place it
    (``reason`` then names the resources it waits for), True once it is (loading its model)."""

    name: str
    waiting_s: float
    needs: dict[str, float]
    placed: bool
    reason: str
