"""Routing policies: which replica of a pool takes a request.

A policy is a small class registered by name; a new one is a new class plus one line in
``_REGISTRY`` (imported lazily), never an edit to an if/elif chain. Policies do no I/O: they get
the live, non-draining candidates with their last reported load plus what this scheduler has in
flight on each (and, for policies that look at it, the prompt's token ids), and return one of them.
A policy may keep state built from its own past choices (``round_robin``'s turn, ``prefix_affinity``'s
prefix index), never anything a worker reports beyond its load.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Sequence
from typing import NamedTuple, Protocol

from controlplane.scheduler.prefix_index import PrefixIndex


class Candidate(NamedTuple):
    """One routable worker as a policy sees it. A NamedTuple, not a dataclass: the scheduler builds one
    per worker per decision (128 for 64-worker pools), and a tuple is made in a quarter of the time."""

    worker_id: str
    address: str
    queued_tokens: int  # reported by the worker's last heartbeat
    free_kv_blocks: int
    total_kv_blocks: int
    running: int
    # This scheduler's own attempts on it, counted live (worker_view.Charge): tokens (decode: held in its KV
    # cache, prompt and generated; prefill and encode: prompt tokens still to compute), requests, KV blocks.
    inflight_tokens: int = 0
    inflight_requests: int = 0
    inflight_blocks: int = 0


# The reported load is as old as the worker's last heartbeat and counts every scheduler's requests; the
# in-flight load is this scheduler's own, current. Each is a lower bound of what the worker holds now, so a
# policy takes the larger of the two (their sum would count this scheduler's requests twice, once they show
# in a heartbeat).

def pending_tokens(c: Candidate) -> int:
    """Prompt tokens the worker has still to compute (prefill, encode)."""
    return max(c.queued_tokens, c.inflight_tokens)


def free_blocks(c: Candidate) -> int:
    """KV blocks the worker has free (decode)."""
    return c.total_kv_blocks - max(c.total_kv_blocks - c.free_kv_blocks, c.inflight_blocks)


def sequences(c: Candidate) -> int:
    """Requests the worker runs."""
    return max(c.running, c.inflight_requests)


# The two keys LeastLoaded sorts by, each the helpers above inlined (one tuple unpacking, no calls): they run
# once per candidate per pick, on the request path. tests/unit/test_routing_policies.py checks they agree.

def decode_key(c: Candidate) -> tuple[int, int, str]:
    """(-``free_blocks``, ``sequences``, worker id): most free KV blocks first."""
    wid, _, _, free, total, running, _, in_requests, in_blocks = c
    used = total - free
    return ((used if used > in_blocks else in_blocks) - total,
            running if running > in_requests else in_requests, wid)


def compute_key(c: Candidate) -> tuple[int, int, str]:
    """(``pending_tokens``, ``sequences``, worker id): fewest tokens to compute first."""
    wid, _, queued, _, _, running, in_tokens, in_requests, _ = c
    return (queued if queued > in_tokens else in_tokens,
            running if running > in_requests else in_requests, wid)


class RoutingPolicy(Protocol):
    name: str

    def pick(self, pool: str, candidates: list[Candidate], prompt_tokens: int, *,
             prompt_ids: Sequence[int] = ()) -> Candidate:
        """``candidates`` is non-empty; return one of them. ``prompt_ids`` are the prompt's token ids
        (``prompt_tokens`` of them) where the caller has them; policies that route on load alone ignore them."""
        ...


class LeastLoaded:
    """Prefill and encode: fewest tokens still to compute (``pending_tokens``), then fewest requests.
    Decode: most free KV blocks (``free_blocks``: prompt and generated tokens held), then fewest
    sequences. Ties go to the lowest worker id, so a choice is deterministic for the same inputs."""

    name = "least_loaded"

    def pick(self, pool: str, candidates: list[Candidate], prompt_tokens: int, *,
             prompt_ids: Sequence[int] = ()) -> Candidate:
        if pool == "decode":
            return min(candidates, key=decode_key)
        return min(candidates, key=compute_key)


class RoundRobin:
    """Each pool's replicas in turn (for comparison and debugging)."""

    name = "round_robin"

    def __init__(self) -> None:
        self._next: dict[str, int] = {}

    def pick(self, pool: str, candidates: list[Candidate], prompt_tokens: int, *,
             prompt_ids: Sequence[int] = ()) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.worker_id)
        i = self._next.get(pool, 0) % len(ordered)
        self._next[pool] = i + 1
        return ordered[i]


class PrefixAffinity:
    """Prefill: the candidate that most recently got the longest prefix of this prompt, unless the pool
    is out of balance; otherwise, and for every other pool, :class:`LeastLoaded`'s choice.

    SGLang's router ``cache_aware`` policy, over vLLM-style chained block hashes. Each prefill choice is
    recorded in the policy's own :class:`PrefixIndex` (no worker reports what it caches), so a later
    prompt sharing a prefix (a system prompt, a conversation's earlier turns) goes where that prefix's
    KV most likely still is, in that worker's prefix cache (``workers.runtime.prefix_cache``), at the price
    of a less even spread. It is not the default: its gain over least loaded (where every replica caches
    the common prefixes on its own) is not measured yet.

    The rule, per prefill pick:
      1. If the pool is imbalanced (SGLang's test: the most and least loaded candidate differ by more than
         ``BALANCE_ABS_TOKENS`` tokens to compute (``pending_tokens``) AND the most loaded has more than
         ``BALANCE_REL`` times the least), least loaded wins: a queue longer than a cache hit could save
         costs more than the hit.
      2. Otherwise the candidate matching the most leading blocks wins; ties go to the least loaded of
         the tied, and no match at all to the least loaded of all.
      3. The winner is recorded against the prompt's blocks (also when step 1 decided, as SGLang does:
         the worker does get the prompt).
    Only ``candidates`` are ever returned; workers the index holds that have not been candidates at two
    sweeps in a row (one every ``SWEEP_EVERY`` picks) are forgotten, freeing their share of the index.

    Encode keeps :class:`LeastLoaded`'s rule: its work is the images, and the prompt ids carry the same
    placeholder token for every image, so a prefix match would say nothing about what an encoder could
    reuse. Decode keeps :class:`LeastLoaded`'s rule (free KV room matters there, and decode never
    recomputes a prefix); in colocated mode only decode is picked, so there this policy is ``least_loaded``.
    """

    name = "prefix_affinity"

    # Imbalance (SGLang's router defaults to 64 requests and 1.5x). In tokens here: 4096 queued tokens is
    # about what a hit on a long shared prefix could save, so a longer extra queue outweighs the hit.
    BALANCE_ABS_TOKENS: int = 4096
    BALANCE_REL: float = 1.5
    INDEX_BLOCKS: int = 100_000  # ~1.6M tokens of prefixes; ~33 MB in `bench micro`'s fill (most blocks on one worker)
    BLOCK_SIZE: int = 16  # the engine's default KV block size, so index blocks line up with the engine's blocks
    SWEEP_EVERY: int = 256  # picks between two looks for workers that left

    def __init__(self, index: PrefixIndex | None = None) -> None:
        self.index = index if index is not None else PrefixIndex(self.INDEX_BLOCKS, self.BLOCK_SIZE)
        self._least = LeastLoaded()
        self._lock = threading.Lock()  # the sweep's bookkeeping; the index has its own lock
        self._picks = 0
        self._missing: frozenset[str] = frozenset()  # indexed workers that were not candidates at the last sweep

    def pick(self, pool: str, candidates: list[Candidate], prompt_tokens: int, *,
             prompt_ids: Sequence[int] = ()) -> Candidate:
        if pool != "prefill":
            return self._least.pick(pool, candidates, prompt_tokens)
        hashes = self.index.hashes(prompt_ids)
        choice = self._choose(pool, candidates, prompt_tokens, hashes)
        if hashes:
            self.index.record(choice.worker_id, hashes)
        self._sweep(candidates)
        return choice

    def imbalanced(self, candidates: list[Candidate]) -> bool:
        loads = [pending_tokens(c) for c in candidates]
        most, least = max(loads), min(loads)
        return most - least > self.BALANCE_ABS_TOKENS and most > least * self.BALANCE_REL

    def _choose(self, pool: str, candidates: list[Candidate], prompt_tokens: int, hashes: list[int]) -> Candidate:
        if not hashes or self.imbalanced(candidates):
            return self._least.pick(pool, candidates, prompt_tokens)
        matched = self.index.match(hashes)
        best = max((matched.get(c.worker_id, 0) for c in candidates), default=0)
        if best == 0:
            return self._least.pick(pool, candidates, prompt_tokens)
        tied = [c for c in candidates if matched.get(c.worker_id, 0) == best]
        return tied[0] if len(tied) == 1 else self._least.pick(pool, tied, prompt_tokens)

    def _sweep(self, candidates: list[Candidate]) -> None:
        """Every ``SWEEP_EVERY`` picks, forget the indexed workers absent from this pick's candidates and
        from the last sweep's (two looks, so one caller's narrowed candidate list forgets nobody)."""
        with self._lock:
            self._picks += 1
            if self._picks % self.SWEEP_EVERY:
                return
            absent = self.index.workers() - {c.worker_id for c in candidates}
            gone = absent & self._missing
            self._missing = absent - gone
        for worker_id in gone:  # a full scan of the index each; rare (a worker left)
            self.index.forget_worker(worker_id)


_REGISTRY: dict[str, str] = {
    "least_loaded": "controlplane.scheduler.policies:LeastLoaded",
    "round_robin": "controlplane.scheduler.policies:RoundRobin",
    "prefix_affinity": "controlplane.scheduler.policies:PrefixAffinity",
}


def available_policies() -> tuple[str, ...]:
    return tuple(_REGISTRY)


def get_policy(name: str) -> RoutingPolicy:
    target = _REGISTRY.get(name)
    if target is None:
        raise ValueError(f"unknown routing policy {name!r}; known: {', '.join(_REGISTRY)}")
    module, cls = target.split(":")
    return getattr(importlib.import_module(module), cls)()
