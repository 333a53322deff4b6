"""An approximate index of which worker recently got which prompt prefix, for cache-aware routing.

The scheduler never hears from a worker what its KV cache holds. Like SGLang's router ``cache_aware``
policy, the index is built from the scheduler's own routing decisions instead: after a prompt is sent to
a worker, its blocks are recorded against that worker, and a later prompt's longest recorded prefix
says which worker most likely still holds the same KV. It is a hint, never a fact: the worker may have
evicted those blocks (or run with ``engine.prefix_caching`` off), and a stale or wrong entry costs only a
less useful routing choice, never a wrong answer.

Blocks are identified the way vLLM's prefix cache does it: one hash per full block of ``block_size``
tokens, each chained on the previous block's hash, so two equal hashes mean two equal whole prefixes
(up to a 64-bit hash collision, which would only misroute one request) and looking up a prompt is a
walk from its first block that stops at the first block nobody holds.

The hashes are Python's built-in ``hash`` of (previous hash, block's tokens) tuples: fast (a 1024-token
prompt is 64 tuple hashes, ~13 us), and process-local: they are not guaranteed stable across Python
builds or versions, so they are never persisted, put on the wire or compared between processes. Each
scheduler process keeps its own index.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence

_ROOT = 0x6570645F70726566  # the chain's start ("epd_pref"); any fixed int will do


def block_hashes(token_ids: Sequence[int], block_size: int) -> list[int]:
    """One hash per full block of ``block_size`` tokens, each chained on the one before (a partial
    trailing block has none: no cache could reuse a block that is not yet full).

    Equal hashes at position ``i`` mean equal tokens in blocks ``0..i``, not just in block ``i``.
    Process-local (see the module docstring).
    """
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    ids = tuple(token_ids)  # a tuple's slices are tuples: one copy here, none per block
    out: list[int] = []
    h = _ROOT
    for start in range(0, len(ids) - block_size + 1, block_size):
        h = hash((h, ids[start:start + block_size]))
        out.append(h)
    return out


class PrefixIndex:
    """Block hash -> the workers that recently got that block, bounded to ``max_blocks`` blocks.

    Each block's workers are kept in the order they last got it (most recent last). The bound is a
    global LRU over blocks: recording touches a block, and past ``max_blocks`` the least recently
    touched blocks go, with every worker on them. A prompt's blocks are touched last-to-first, so within
    one prompt the head (the part other prompts share: system prompts, few-shot examples) is the most
    recent and the tail is evicted first, as vLLM frees a request's blocks tail first. Evicting a head
    before its tail would leave the tail unreachable, since :meth:`match` stops at the first missing block.

    Costs: :meth:`record` and :meth:`match` are O(prompt blocks x workers holding each block), that is
    O(prefix blocks) for a bounded number of workers, independent of the index's size;
    :meth:`forget_worker` scans the whole index (O(max_blocks)), once per worker that leaves.
    One lock guards everything, so the scheduler's request threads can share an index.
    """

    def __init__(self, max_blocks: int = 100_000, block_size: int = 16) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks must be >= 1, got {max_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.max_blocks = max_blocks
        self.block_size = block_size
        self._blocks: OrderedDict[int, dict[str, None]] = OrderedDict()  # least recently touched first
        self._per_worker: dict[str, int] = {}  # worker -> blocks it is on (so an unknown worker costs nothing)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        """Indexed blocks."""
        return len(self._blocks)

    def workers(self) -> frozenset[str]:
        """The workers on at least one indexed block."""
        with self._lock:
            return frozenset(self._per_worker)

    def hashes(self, token_ids: Sequence[int]) -> list[int]:
        """:func:`block_hashes` at this index's block size."""
        return block_hashes(token_ids, self.block_size)

    def record(self, worker_id: str, hashes: Sequence[int]) -> None:
        """``worker_id`` just got the prompt whose chained block hashes are ``hashes``."""
        with self._lock:
            blocks, counts = self._blocks, self._per_worker
            for h in reversed(hashes):  # the head ends up most recent (see the class docstring)
                holders = blocks.get(h)
                if holders is None:
                    blocks[h] = {worker_id: None}
                    counts[worker_id] = counts.get(worker_id, 0) + 1
                    continue
                blocks.move_to_end(h)
                if worker_id in holders:
                    del holders[worker_id]  # re-inserted below as the most recent
                else:
                    counts[worker_id] = counts.get(worker_id, 0) + 1
                holders[worker_id] = None
            while len(blocks) > self.max_blocks:
                _, gone = blocks.popitem(last=False)
                for w in gone:
                    self._drop_one(w)

    def match(self, hashes: Sequence[int]) -> dict[str, int]:
        """Worker -> how many leading blocks of ``hashes`` it holds contiguously (only workers with at
        least one). The walk stops at the first block no worker still in the running holds.

        Read-only: it does not touch the LRU order (the caller records its choice, which does).
        """
        out: dict[str, int] = {}
        alive: list[str] = []
        n = 0
        with self._lock:
            blocks = self._blocks
            for h in hashes:
                holders = blocks.get(h)
                if holders is None:
                    break
                if n == 0:
                    still = list(holders)
                else:
                    still = []
                    for w in alive:
                        if w in holders:
                            still.append(w)
                        else:
                            out[w] = n
                if not still:
                    break
                alive = still
                n += 1
        for w in alive:
            out[w] = n
        return out

    def forget_worker(self, worker_id: str) -> None:
        """Drop ``worker_id`` from every block (a worker that left); blocks nobody else holds go too.
        Free for a worker the index does not know; a full scan otherwise."""
        with self._lock:
            if worker_id not in self._per_worker:
                return
            for h in [h for h, holders in self._blocks.items() if worker_id in holders]:
                holders = self._blocks[h]
                del holders[worker_id]
                if not holders:
                    del self._blocks[h]
            del self._per_worker[worker_id]

    def _drop_one(self, worker_id: str) -> None:
        left = self._per_worker[worker_id] - 1
        if left:
            self._per_worker[worker_id] = left
        else:
            del self._per_worker[worker_id]
