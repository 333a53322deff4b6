"""Prefix caching: a new sequence reuses the KV of the leading full blocks an earlier one computed.

Keys. Each full block of ``block_size`` tokens is keyed by a chained SHA-256 digest of the previous
block's digest and this block's token ids, so equal digests mean equal whole prefixes, not just equal
blocks. The hash is cryptographic because a collision would hand one request another's KV (vLLM moved
from Python's ``hash`` to SHA-256 for the same reason). The index lives in the ``BlockAllocator``.

What is cached. A block is registered once the KV of all its tokens is in the cache, whether they are
prompt or output tokens. Registered blocks are never written again. Only blocks before a sequence's
``cacheable_tokens`` are cached: the KV of a multimodal placeholder (and of every token after it) depends
on the image's embeddings, not on the token ids.

Lookup. When a sequence that holds no blocks is admitted (new, or preempted and back), it takes the
longest cached prefix of its full blocks, stopping before its last token, since that token must be
computed to sample the next one. It then computes from the first block it did not find, into blocks of
its own. A sequence that asks for prompt logprobs skips the lookup: it needs every prompt position's
logits. Cached prefixes change which tokens a step computes, so like chunked prefill they may move
logits in the last bits; what the cache holds is the KV an earlier step computed for the same tokens.
"""

from __future__ import annotations

import hashlib
from array import array

from workers.runtime.kv_cache import BlockAllocator
from workers.runtime.sequence import Sequence

ROOT_DIGEST = hashlib.sha256(b"epd prefix cache v1").digest()


def chain_digests(tokens: list[int], block_size: int, parent: bytes = ROOT_DIGEST) -> list[bytes]:
    """One digest per full block of ``tokens`` (a partial tail has none), each chained on the one before,
    starting from ``parent``."""
    out = []
    for start in range(0, len(tokens) - block_size + 1, block_size):
        parent = hashlib.sha256(parent + array("q", tokens[start:start + block_size]).tobytes()).digest()
        out.append(parent)
    return out


class PrefixCache:
    """The engine's side of prefix caching: digests per sequence, lookup at admission, registration after
    each step, and the hit counters. ``enabled`` False keeps the counters at zero and caches nothing."""

    def __init__(self, allocator: BlockAllocator, block_size: int, enabled: bool = True) -> None:
        self.allocator = allocator
        self.block_size = block_size
        self.enabled = enabled
        self.queried_tokens = 0  # prompt tokens of admitted sequences that looked up the cache
        self.hit_tokens = 0  # of which their KV was found cached

    def _digests(self, seq: Sequence, num_blocks: int) -> list[bytes]:
        """``seq``'s first ``num_blocks`` block digests, computed once per sequence (its tokens only grow)."""
        have = len(seq.block_digests)
        if have < num_blocks:
            bs = self.block_size
            parent = seq.block_digests[-1] if have else ROOT_DIGEST
            seq.block_digests.extend(chain_digests(seq.tokens(have * bs, num_blocks * bs), bs, parent))
        return seq.block_digests[:num_blocks]

    def _cacheable_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return min(num_tokens, seq.cacheable_tokens) // self.block_size

    def lookup(self, seq: Sequence) -> list[int]:
        """The cached blocks of ``seq``'s longest cached prefix, short of its last token; takes nothing."""
        if not self.enabled or seq.params.prompt_logprobs is not None:
            return []
        return self.allocator.match(self._digests(seq, self._cacheable_blocks(seq, seq.num_tokens - 1)))

    def match_prompt(self, prompt_ids: list[int], cacheable_tokens: int) -> list[int]:
        """The cached blocks of the longest cached prefix of a prompt whose KV is to arrive from another worker
        (a reservation), short of its last token, and before ``cacheable_tokens``; takes nothing."""
        if not self.enabled:
            return []
        bs = self.block_size
        n = min(len(prompt_ids) - 1, cacheable_tokens) // bs
        return self.allocator.match(chain_digests(prompt_ids[:n * bs], bs))

    def count(self, seq: Sequence, hit_blocks: int) -> None:
        """Count an admitted sequence's lookup (once per admission, a preempted one's again)."""
        if seq.params.prompt_logprobs is None:
            self.count_tokens(seq.num_tokens, hit_blocks)

    def count_tokens(self, num_tokens: int, hit_blocks: int) -> None:
        """Count a lookup of ``num_tokens`` tokens that found ``hit_blocks`` blocks."""
        if self.enabled:
            self.queried_tokens += num_tokens
            self.hit_tokens += hit_blocks * self.block_size

    def register(self, seq: Sequence) -> None:
        """Index ``seq``'s blocks that became full and computed since the last call."""
        if not self.enabled:
            return
        done = self._cacheable_blocks(seq, seq.num_computed)
        if done <= seq.num_registered:
            return
        digests = self._digests(seq, done)
        for i in range(seq.num_registered, done):
            self.allocator.register(seq.block_table[i], digests[i])  # False: another block holds it, keep ours
        seq.num_registered = done
