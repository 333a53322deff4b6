"""Errors of the Redis state layer. Callers never see a raw ``redis`` exception for a lost connection."""

from __future__ import annotations


class StateError(Exception):
    """Base of the state layer's errors."""


class StateUnavailable(StateError):
    """Redis could not be reached (or answered too slowly) after the client's retries.

    ``url`` has any password masked. The redis-py error is chained as ``__cause__``.
    """

    def __init__(self, url: str, reason: str) -> None:
        super().__init__(f"cannot reach Redis at {url}: {reason}")
        self.url = url
        self.reason = reason


class StateRefused(StateUnavailable):
    """Redis answered but refuses writes: at ``maxmemory`` with ``noeviction``, or a read-only replica.
    Handled as ``StateUnavailable`` (it passes when Redis has room again); the message says which."""

    def __init__(self, url: str, reason: str) -> None:
        StateError.__init__(self, f"Redis at {url} refuses writes: {reason}")
        self.url = url
        self.reason = reason


class WorkerNotRegistered(StateError, LookupError):
    """A heartbeat or update for a worker whose lease is gone; the worker must register again."""


class RedisServerNotFound(StateError, FileNotFoundError):
    """``redis-server`` is not installed where ``LocalRedis`` looks for it."""
