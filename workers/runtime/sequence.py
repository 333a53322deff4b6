"""Per-request state inside one engine.

A sequence's life:
  1. WAITING   queued; holds no blocks (a preempted sequence comes back here, blocks freed).
  2. RUNNING   holds blocks; each step computes its next prompt chunk or one decode token.
               Tokens [0, num_computed) have their k/v in the cache.
  3. FINISHED  stop token/string, max_tokens, context end, or abort; blocks are freed.
"""

from __future__ import annotations

import bisect
import enum
import sys
from dataclasses import dataclass, field

import torch

from workers.runtime.sampler import SamplingParams, TokenLogprobs
from workers.runtime.tokenizer import IncrementalDetokenizer


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"  # eos, a stop token id or a stop string
    LENGTH = "length"  # max_tokens or the model's context
    ABORT = "abort"


@dataclass(frozen=True)
class MultimodalInput:
    """Embeddings that replace the prompt's placeholder tokens, in prompt order."""

    embeds: torch.Tensor  # [n, hidden]
    positions: tuple[int, ...]  # prompt indices of the placeholders, ascending


@dataclass(eq=False)
class Sequence:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    seed: int  # with an output token's index, seeds that token's draw (``sampler.seed_draw``)
    arrival: float
    mm: MultimodalInput | None = None
    detok: IncrementalDetokenizer | None = None
    output_ids: list[int] = field(default_factory=list)
    # Grows by appending only; when the blocks are given back it is replaced, never edited in place (the
    # CUDA graphs' staging writes only a table's new entries: workers.runtime.cuda_graphs.DecodeBuffers).
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    status: SequenceStatus = SequenceStatus.WAITING
    finish_reason: FinishReason | None = None
    num_preemptions: int = 0
    generator: torch.Generator = field(default_factory=torch.Generator)
    # params.prompt_logprobs: each prompt token's after the first, gathered chunk by chunk before the first
    # output token (a prefill computed again after a preemption gathers them again)
    prompt_logprobs: list[TokenLogprobs] = field(default_factory=list)
    # Prefix cache (workers.runtime.prefix_cache): the first ``cacheable_tokens`` tokens' KV depends on their
    # ids alone (a multimodal placeholder's on its image: lowered to the first one at construction); the
    # chained digests of the full blocks hashed so far; how many of its blocks are indexed or were tried.
    cacheable_tokens: int = sys.maxsize
    # False: its KV came from images this engine never saw (adopted on a decode worker), so a preemption
    # cannot recompute it; the scheduler preempts others first, and ends it (evicted) when it must
    recomputable: bool = True
    block_digests: list[bytes] = field(default_factory=list)
    num_registered: int = 0

    def __post_init__(self) -> None:
        if self.mm is not None and self.mm.positions:
            self.cacheable_tokens = min(self.cacheable_tokens, self.mm.positions[0])

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def is_decoding(self) -> bool:
        """One token left to compute, and it is a sampled one: a decode step."""
        return bool(self.output_ids) and self.num_tokens - self.num_computed == 1

    def tokens(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_ids)
        if end <= p:
            return self.prompt_ids[start:end]
        return (self.prompt_ids[start:] if start < p else []) + self.output_ids[max(0, start - p):end - p]

    def embeds_in(self, start: int, end: int) -> tuple[list[int], torch.Tensor] | None:
        """Offsets (from ``start``) and rows of the multimodal embeddings inside [start, end)."""
        if self.mm is None:
            return None
        lo = bisect.bisect_left(self.mm.positions, start)
        hi = bisect.bisect_left(self.mm.positions, end)
        if lo == hi:
            return None
        return [p - start for p in self.mm.positions[lo:hi]], self.mm.embeds[lo:hi]
