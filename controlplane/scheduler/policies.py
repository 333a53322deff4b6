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
    # Set only on the candidate a cache-aware policy returns: the prompt tokens it guesses the worker caches
    # (its prefix cache computes or holds only the rest, so the attempt charges only the rest to its load).
    cached_tokens: int = 0


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
    wid, _, _, free, total, running, _, in_requests, in_blocks, _ = c
    used = total - free
    return ((used if used > in_blocks else in_blocks) - total,
            running if running > in_requests else in_requests, wid)


def compute_key(c: Candidate) -> tuple[int, int, str]:
    """(``pending_tokens``, ``sequences``, worker id): fewest tokens to compute first."""
    wid, _, queued, _, _, running, in_tokens, in_requests, _, _ = c
    return (queued if queued > in_tokens else in_tokens,
            running if running > in_requests else in_requests, wid)


class RoutingPolicy(Protocol):
    name: str

    def pick(self, pool: str, candidates: list[Candidate], prompt_tokens: int, *,
             prompt_ids: Sequence[int] = ()) -> Candidate:
        """``candidates`` is non-empty; return one of them (its ``cached_tokens`` may be set). ``prompt_ids`` are
        the prompt's token ids up to its first image, where the caller has them (``prompt_tokens`` counts them
        all); policies that route on load alone ignore them."""
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
    """Cache-aware routing: prefill and decode prompts go where their longest prefix most likely is, in that
    worker's prefix cache (``workers.runtime.prefix_cache``), unless the pool is out of balance.

    SGLang's router ``cache_aware`` policy, over vLLM-style chained block hashes. No worker reports what it
    caches, so the policy keeps one approximate :class:`PrefixIndex` per pool, built from its own choices:
    each pick is recorded against the prompt's blocks, and a later prompt sharing a prefix (a system prompt,
    a conversation's earlier turns) goes where that prefix was sent. The index can be wrong (the worker
    evicted the blocks, or runs with ``engine.prefix_caching`` off); a wrong guess costs a less even spread,
    never a wrong answer.

    The rule, per pick of a prefill or decode replica (a colocated worker is a decode replica):
      1. If the pool is imbalanced (SGLang's test: the most and the least loaded candidate differ by more than
         an absolute gap AND the most loaded carries more than ``BALANCE_REL`` times the least), least loaded
         wins: a queue longer than a hit could save costs more than the hit. Load is the pool's own unit:
         prefill, tokens to compute (``pending_tokens``, gap ``BALANCE_ABS_TOKENS``); decode, KV blocks
         held (gap ``BALANCE_ABS_TOKENS / BLOCK_SIZE`` blocks); and in either pool, requests (``sequences``,
         gap ``BALANCE_ABS_REQUESTS``).
      2. Otherwise the candidate matching the most leading blocks wins, if they hold at least
         ``CACHE_THRESHOLD`` of the prompt; ties go to the least loaded of the tied. A shorter match (a chat
         template's few fixed tokens, a short system prompt before a long document) would save too little
         compute to be worth the stickiness: the least loaded of all wins, as when nothing matches.
         A decode winner without the free blocks for the prompt's uncached part gives way to least loaded too
         (it would refuse the request for room).
      3. The winner is recorded against the prompt's blocks (also when step 1 decided, as SGLang does: the
         worker does get the prompt), and returned with ``cached_tokens`` set to what it likely caches, so the
         attempt charges its load only the rest. That keeps a worker that computes short suffixes of a cached
         prefix from looking as busy as one computing whole prompts, which would trip step 1.
    SGLang's fixed thresholds, not a cost that trades a hit's tokens against queued tokens one for one (NVIDIA
    Dynamo's KV router): a hit saves compute for every request behind it too, and ``scripts/routing_ab.sh``
    measured the thresholds ahead (docs/performance.md, "Cache-aware routing, served").

    Encode stays :class:`LeastLoaded`: its work is the images, and every image's placeholder tokens are the
    same, so a prompt match says nothing about what an encoder could reuse. The caller passes the prompt up to
    its first image only (the engines cache no block from there on). Only ``candidates`` are returned; workers
    an index holds that were no pick's candidate for two sweep periods (``SWEEP_EVERY`` picks of the pool
    each) are forgotten, freeing their share of the index.
    """

    name = "prefix_affinity"

    # Imbalance (SGLang's router defaults to 64 requests and 1.5x). In tokens here: 4096 queued tokens is
    # about what a hit on a long shared prefix could save, so a longer extra queue outweighs the hit.
    BALANCE_ABS_TOKENS: int = 4096
    BALANCE_REL: float = 1.5
    # ... or in requests (sequences), SGLang's own unit: half the dispatcher's default per-worker call cap
    # (transfer.max_streams, 64), so a hot prefix lets go of a replica well before the cap makes requests wait
    BALANCE_ABS_REQUESTS: int = 32
    CACHE_THRESHOLD: float = 0.5  # the share of the prompt a match must cover (SGLang's router default)
    INDEX_BLOCKS: int = 100_000  # per pool: ~1.6M tokens of prefixes; ~33 MB in `bench micro`'s fill
    BLOCK_SIZE: int = 16  # the engine's default KV block size, so index blocks line up with the engine's blocks
    SWEEP_EVERY: int = 256  # picks of one pool between two looks for workers that left

    def __init__(self, index: PrefixIndex | None = None, decode_index: PrefixIndex | None = None) -> None:
        self.indexes = {"prefill": index if index is not None else PrefixIndex(self.INDEX_BLOCKS, self.BLOCK_SIZE),
                        "decode": decode_index if decode_index is not None
                        else PrefixIndex(self.INDEX_BLOCKS, self.BLOCK_SIZE)}
        self._least = LeastLoaded()
        self._lock = threading.Lock()  # the sweeps' bookkeeping; each index has its own lock
        self._picks = {pool: 0 for pool in self.indexes}
        self._missing: dict[str, frozenset[str]] = {pool: frozenset() for pool in self.indexes}
        self._seen: dict[str, set[str]] = {pool: set() for pool in self.indexes}  # candidates since the last sweep
        self._memo = threading.local()  # per thread: the last prompt hashed, its block size and its hashes

    @property
    def index(self) -> PrefixIndex:
        """The prefill pool's index."""
        return self.indexes["prefill"]

    def pick(self, pool: str, candidates: list[Candidate], prompt_tokens: int, *,
             prompt_ids: Sequence[int] = ()) -> Candidate:
        index = self.indexes.get(pool)
        if index is None:
            return self._least.pick(pool, candidates, prompt_tokens)
        hashes = self._hashes(index, prompt_ids)
        choice = self._choose(pool, candidates, prompt_tokens, index, hashes)
        if hashes:
            index.record(choice.worker_id, hashes)
        self._sweep(pool, index, candidates)
        return choice

    def _hashes(self, index: PrefixIndex, prompt_ids: Sequence[int]) -> list[int]:
        """``index.hashes(prompt_ids)``, hashed once for a request's decode and prefill picks: the scheduler
        passes both the same sequence, which this thread's last call kept (with it, so identity is exact)."""
        memo = getattr(self._memo, "last", None)
        if memo is not None and memo[0] is prompt_ids and memo[1] == index.block_size:
            return memo[2]
        hashes = index.hashes(prompt_ids)
        self._memo.last = (prompt_ids, index.block_size, hashes)
        return hashes

    def imbalanced(self, pool: str, candidates: list[Candidate]) -> bool:
        """Step 1's test, in ``pool``'s unit of load."""
        # blocks held (total - free_blocks) and pending_tokens, inlined: this runs per candidate per pick
        if pool == "decode":
            loads = [u if u > b else b for u, b in [(c[4] - c[3], c[8]) for c in candidates]]
            gap = self.BALANCE_ABS_TOKENS // self.BLOCK_SIZE
        else:
            loads = [q if q > t else t for q, t in [(c[2], c[6]) for c in candidates]]
            gap = self.BALANCE_ABS_TOKENS
        most, least = max(loads), min(loads)
        if most - least > gap and most > least * self.BALANCE_REL:
            return True
        requests = [r if r > i else i for r, i in [(c[5], c[7]) for c in candidates]]  # sequences(c), inlined
        most, least = max(requests), min(requests)
        return most - least > self.BALANCE_ABS_REQUESTS and most > least * self.BALANCE_REL

    def _choose(self, pool: str, candidates: list[Candidate], prompt_tokens: int, index: PrefixIndex,
                hashes: list[int]) -> Candidate:
        if not hashes or self.imbalanced(pool, candidates):
            return self._least.pick(pool, candidates, prompt_tokens)
        matched = index.match(hashes)
        best = max((matched.get(c.worker_id, 0) for c in candidates), default=0)
        if best == 0 or best * index.block_size < self.CACHE_THRESHOLD * prompt_tokens:
            return self._least.pick(pool, candidates, prompt_tokens)
        tied = [c for c in candidates if matched.get(c.worker_id, 0) == best]
        choice = tied[0] if len(tied) == 1 else self._least.pick(pool, tied, prompt_tokens)
        # the engine's rule: whole blocks, short of the prompt's last token, which is always computed
        size = index.block_size
        cached = min(best, max(prompt_tokens - 1, 0) // size) * size
        if pool == "decode" and free_blocks(choice) < -(-(prompt_tokens - cached) // size):
            return self._least.pick(pool, candidates, prompt_tokens)  # it would refuse the request for room
        return choice._replace(cached_tokens=cached) if cached else choice

    def _sweep(self, pool: str, index: PrefixIndex, candidates: list[Candidate]) -> None:
        """Every ``SWEEP_EVERY`` picks of ``pool``, forget the workers its index holds that were a candidate of
        no pick since the last sweep, nor in the period before: a replica left out of some requests' lists (one
        that refused them for room, one they lost) is still a candidate of others' and stays."""
        with self._lock:
            seen = self._seen[pool]
            seen.update([c[0] for c in candidates])
            self._picks[pool] += 1
            if self._picks[pool] % self.SWEEP_EVERY:
                return
            absent = index.workers() - seen
            seen.clear()
            gone = absent & self._missing[pool]
            self._missing[pool] = absent - gone
        for worker_id in gone:  # a full scan of the index each; rare (a worker left)
            index.forget_worker(worker_id)


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
