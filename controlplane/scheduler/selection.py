"""Route selection: which decode, prefill and (images) encode replica take one attempt of a request.

Candidates are the view's live, non-draining workers whose circuit breaker lets them be routed
(``health``), less those the caller excludes: decode replicas that refused this attempt for room, and
workers this request already lost. The policy picks among the rest. A request that needs a prefill
or encode replica when none is routable fails at once with 503 and Retry-After.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from dataclasses import dataclass

from controlplane.backend import BackendError
from controlplane.dispatch import Route, WorkerRequest
from controlplane.scheduler.health import WorkerHealth
from controlplane.scheduler.policies import Candidate, RoutingPolicy
from controlplane.scheduler.worker_view import WorkerView
from controlplane.state.errors import StateError

RETRY_AFTER_S = 1.0  # what a 503 of the routing stage tells the client to wait


@dataclass(frozen=True)
class Selection:
    """The replicas of one attempt. ``prefill`` is None for a colocated route."""

    decode: Candidate
    prefill: Candidate | None = None
    encode: Candidate | None = None

    @property
    def route(self) -> Route:
        return Route(self.decode.address, self.prefill.address if self.prefill else None,
                     self.encode.address if self.encode else None)

    @property
    def workers(self) -> tuple[Candidate, ...]:
        return tuple(c for c in (self.decode, self.prefill, self.encode) if c is not None)

    def worker_at(self, address: str) -> str | None:
        """The id of this selection's worker at ``address``."""
        return next((c.worker_id for c in self.workers if c.address == address), None)

    def ids(self, addresses: tuple[str, ...]) -> list[str]:
        """The ids of this selection's workers at ``addresses`` (an address it does not hold stands for itself)."""
        return [self.worker_at(a) or a for a in addresses]

    def describe(self) -> str:
        """``decode=ID prefill=ID encode=ID`` (the journal's detail of the attempt)."""
        return " ".join(f"{name}={c.worker_id}" for name, c in (("decode", self.decode), ("prefill", self.prefill),
                                                                 ("encode", self.encode)) if c is not None)


def cacheable_ids(request: WorkerRequest) -> list[int]:
    """The prompt up to its first image: the part an engine's prefix cache can hold (it caches no block from
    an image's placeholder tokens on, since they stand for different images in different requests)."""
    if not request.image_positions:
        return request.prompt_ids
    return request.prompt_ids[:min(request.image_positions)]


class RouteSelector:
    def __init__(self, view: WorkerView, policy: RoutingPolicy, health: WorkerHealth, *, colocated: bool,
                 max_calls: int | None = None) -> None:
        """``max_calls``: the dispatcher's per-worker call cap. A worker this scheduler already has that many
        attempts on is left out while another candidate is under it (its call would fail busy, and a policy
        that follows a cached prefix would keep choosing it); when every one is at it, all stay candidates
        and the attempt waits, busy, as before."""
        self.view = view
        self.policy = policy
        self.health = health
        self.colocated = colocated
        self.max_calls = max_calls

    def candidates(self, pool: str) -> list[Candidate]:
        """The pool's live workers; a Redis outage with no snapshot yet is a 503 that says so."""
        try:
            return self.view.candidates(pool)
        except StateError as exc:
            raise BackendError(f"the routing state (Redis) is unavailable, retry shortly: {exc}", 503,
                               retry_after_s=RETRY_AFTER_S) from None

    def pick(self, pool: str, request: WorkerRequest, exclude: Set[str], prompt_ids: Sequence[int]) -> Candidate | None:
        """``prompt_ids``: ``cacheable_ids(request)``, one sequence for all of a request's picks."""
        routable = [c for c in self.candidates(pool)
                    if c.worker_id not in exclude and self.health.routable(c.worker_id)]
        if not routable:
            return None
        if self.max_calls is not None and len(routable) > 1:
            cap = self.max_calls
            open_ = [c for c in routable if c.inflight_requests < cap]
            if open_:
                routable = open_
        return self.policy.pick(pool, routable, len(request.prompt_ids), prompt_ids=prompt_ids)

    def select(self, request: WorkerRequest, refused: Set[str], lost: Set[str] = frozenset()) -> Selection | None:
        """A route, or None when no decode replica is left to try (the caller waits for room)."""
        ids = cacheable_ids(request)  # one sequence for every pick, so a policy can hash it once
        decode = self.pick("decode", request, refused | lost, ids)
        if decode is None:
            return None
        if self.colocated:
            return Selection(decode)
        prefill = self.pick("prefill", request, lost, ids)
        encode = self.pick("encode", request, lost, ids) if request.images else None
        missing = [pool for pool, c in (("prefill", prefill), ("encode", encode))
                   if c is None and (pool == "prefill" or request.images)]
        if missing:
            raise BackendError(f"no live {' or '.join(missing)} replica to serve the request", 503,
                               retry_after_s=RETRY_AFTER_S)
        return Selection(decode, prefill, encode)
