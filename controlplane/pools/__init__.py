"""The encode, prefill and decode pools: Ray actors running worker services, kept at their Redis targets.

``PoolManager`` (manager.py) starts, scales, drains and replaces replicas; ``WorkerActor`` (actor.py) is
one replica; ``replica.py`` is what runs inside it; ``ray_runtime.py`` connects to or starts Ray.
"""

from controlplane.pools.manager import PoolManager, Replica
from controlplane.pools.status import PoolError, PoolStatus, ReplicaStatus, WorkerStartError

__all__ = ["PoolError", "PoolManager", "PoolStatus", "Replica", "ReplicaStatus", "WorkerStartError"]
