"""Routing policies: which replica of a pool takes a request.

A policy is a small class registered by name; a new one is a new class plus one line in
``_REGISTRY`` (imported lazily), never an edit to an if/elif chain. Policies are pure: they get
the live, non-draining candidates with their last reported load plus what this scheduler has in
flight on each, and return one worker id.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Candidate:
    worker_id: str
    address: str
    queued_tokens: int  # reported by the worker's last heartbeat
    free_kv_blocks: int
    total_kv_blocks: int
    running: int
    inflight_tokens: int = 0  # prompt tokens this scheduler sent it since (not yet in its heartbeat)
    inflight_requests: int = 0


class RoutingPolicy(Protocol):
    name: str

    def pick(self, pool: str, candidates: list[Candidate], prompt_tokens: int) -> Candidate:
        """``candidates`` is non-empty; return one of them."""
        ...


class LeastLoaded:
    """Prefill and encode: fewest queued tokens (reported + in flight). Decode: most free KV blocks
    after what is in flight, then fewest running requests. Ties go to the lowest worker id, so a
    choice is deterministic for the same inputs."""

    name = "least_loaded"

    def pick(self, pool: str, candidates: list[Candidate], prompt_tokens: int) -> Candidate:
        if pool == "decode":
            return min(candidates, key=lambda c: (-(c.free_kv_blocks - c.inflight_tokens // 16),
                                                  c.running + c.inflight_requests, c.worker_id))
        return min(candidates, key=lambda c: (c.queued_tokens + c.inflight_tokens,
                                              c.running + c.inflight_requests, c.worker_id))


class RoundRobin:
    """Each pool's replicas in turn (for comparison and debugging)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, pool: str, candidates: list[Candidate], prompt_tokens: int) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        i = self._next.get(pool, 0) % len(ordered)
        self._next[pool] = i + 1
        return ordered[i]


_REGISTRY: dict[str, str] = {
    "least_loaded": "controlplane.scheduler.policies:LeastLoaded",
    "round_robin": "controlplane.scheduler.policies:RoundRobin",
}


def available_policies() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_policy(name: str) -> RoutingPolicy:
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(_REGISTRY)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()
