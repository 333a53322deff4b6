"""Control-plane state in Redis: worker leases, pool targets, request journal, counters.

``keys`` documents every key. Build a ``StateConnection`` with ``connect(url, prefix)`` (or start a
private server with ``LocalRedis``), then wrap it in the stores below.
"""

from controlplane.state.client import LocalRedis, StateConnection, connect
from controlplane.state.clock import Clock, ManualClock, SystemClock
from controlplane.state.counters import Counters
from controlplane.state.errors import (
    RedisServerNotFound,
    StateError,
    StateRefused,
    StateUnavailable,
    WorkerNotRegistered,
)
from controlplane.state.journal import JournalEntry, RequestJournal, RequestState
from controlplane.state.keys import DEFAULT_PREFIX, InvalidKeyPart, KeySpace, Pool
from controlplane.state.pools import PoolTargets
from controlplane.state.registry import WorkerInfo, WorkerLoad, WorkerRecord, WorkerRegistry

__all__ = [
    "Clock", "Counters", "DEFAULT_PREFIX", "InvalidKeyPart", "JournalEntry", "KeySpace", "LocalRedis",
    "ManualClock", "Pool", "PoolTargets", "RedisServerNotFound", "RequestJournal", "RequestState",
    "StateConnection", "StateError", "StateRefused", "StateUnavailable", "SystemClock", "WorkerInfo", "WorkerLoad",
    "WorkerNotRegistered", "WorkerRecord", "WorkerRegistry", "connect",
]
