"""The engine's own scheduler: admission, chunked prefill, continuous batching, preemption.

Each step it builds one batch under a token budget:
  1. Running sequences, oldest first: one token each if decoding, else their next prompt chunk.
     If a sequence needs a block and none is free, the newest running sequence is preempted (blocks
     freed, recomputed later from its prompt and outputs; taken out of this step's batch if it was in
     it), until the block is found. One that cannot be recomputed (``Sequence.recomputable``) goes only
     when no running sequence can be, and is then evicted: finished, for its caller to move it.
  2. Waiting sequences, first come first served, while the budget, ``max_num_seqs`` and free
     blocks allow. A sequence that does not fit waits: the queue is never reordered past it.
     Admission counts a prompt whole: a sequence joins only if the free blocks cover its whole
     prompt as well as the rest of every running sequence's prompt, though it takes only its first
     chunk's blocks now. So prompts admitted together never run the pool out between them (a
     preempted prompt throws away the chunks it had computed). Decoding sequences' growth is not
     counted: on an engine that also decodes, it can still preempt the newest running sequence.
     With a prefix cache, a joining sequence first takes the cached blocks of its longest cached
     prefix and starts computing after them (workers.runtime.prefix_cache).
Sequences join and leave between steps; nothing here touches tensors.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from workers.runtime.errors import InvalidRequestError
from workers.runtime.kv_cache import BlockAllocator
from workers.runtime.prefix_cache import PrefixCache
from workers.runtime.sequence import FinishReason, Sequence, SequenceStatus


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048  # tokens computed per step, decode and prefill together
    prefill_chunk_size: int = 512  # most prompt tokens of one sequence per step

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1 or self.prefill_chunk_size < 1:
            raise InvalidRequestError("max_num_seqs and prefill_chunk_size must be >= 1")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise InvalidRequestError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running sequence can decode each step")


@dataclass(frozen=True)
class ScheduledChunk:
    seq: Sequence
    start: int
    end: int


@dataclass(frozen=True)
class SchedulerOutput:
    decodes: list[Sequence]
    prefills: list[ScheduledChunk]
    preempted: list[Sequence]
    evicted: list[Sequence] = field(default_factory=list)  # preempted, but not recomputable: finished (ABORT)

    @property
    def empty(self) -> bool:
        return not self.decodes and not self.prefills


class Scheduler:
    def __init__(self, config: SchedulerConfig, allocator: BlockAllocator, block_size: int,
                 prefix_cache: PrefixCache | None = None) -> None:
        self.config = config
        self.allocator = allocator
        self.block_size = block_size
        self.prefix_cache = prefix_cache or PrefixCache(allocator, block_size, enabled=False)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []

    def add(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def adopt(self, seq: Sequence) -> None:
        """Run a sequence that already holds its blocks and computed prompt (a received KV cache)."""
        seq.status = SequenceStatus.RUNNING
        self.running.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _ensure_blocks(self, seq: Sequence, num_tokens: int) -> bool:
        need = -(-num_tokens // self.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        if not self.allocator.can_allocate(need):
            return False
        seq.block_table.extend(self.allocator.allocate(need))
        return True

    def _blocks_to_finish_prompt(self, seq: Sequence) -> int:
        """Blocks ``seq`` still needs before its prompt (for one recomputed: prompt and outputs so far) is
        all computed, beyond those it holds."""
        return max(0, -(-seq.num_tokens // self.block_size) - len(seq.block_table))

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.free(seq.block_table)
        seq.block_table = []
        seq.num_computed = 0
        seq.num_registered = 0

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _victim(self) -> Sequence:
        """Whom to preempt: the newest running sequence that can be recomputed, else the newest."""
        return next((s for s in reversed(self.running) if s.recomputable), self.running[-1])

    def finish(self, seq: Sequence, reason: FinishReason) -> None:
        """Take ``seq`` out of the queues and free its blocks (idempotent)."""
        if seq.status is SequenceStatus.FINISHED:
            return
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        else:
            self.waiting.remove(seq)
        self._release(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason

    def _take_cached_prefix(self, seq: Sequence) -> int:
        """Give a waiting ``seq`` (which holds no blocks) its longest cached prefix's blocks, as computed.
        Returns how many blocks it took."""
        hit = self.prefix_cache.lookup(seq)
        if hit:
            self.allocator.take(hit)
            seq.block_table = list(hit)
            seq.num_computed = len(hit) * self.block_size
            seq.num_registered = len(hit)
        return len(hit)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        decodes: list[Sequence] = []
        prefills: list[ScheduledChunk] = []
        preempted: list[Sequence] = []
        evicted: list[Sequence] = []

        for seq in list(self.running):
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = 1 if seq.is_decoding else min(seq.num_tokens - seq.num_computed,
                                               self.config.prefill_chunk_size, budget)
            if n <= 0:
                continue
            while not self._ensure_blocks(seq, seq.num_computed + n):
                victim = self._victim()
                if victim in decodes:  # scheduled earlier in this loop: out of the batch again
                    decodes.remove(victim)
                    budget += 1
                for chunk in [c for c in prefills if c.seq is victim]:
                    prefills.remove(chunk)
                    budget += chunk.end - chunk.start
                if victim.recomputable:
                    self._preempt(victim)
                    preempted.append(victim)
                else:
                    self.finish(victim, FinishReason.ABORT)
                    evicted.append(victim)
                if victim is seq:
                    break
            if seq.status is not SequenceStatus.RUNNING:
                continue
            budget -= n
            if seq.is_decoding:
                decodes.append(seq)
            else:
                prefills.append(ScheduledChunk(seq, seq.num_computed, seq.num_computed + n))

        committed = sum(self._blocks_to_finish_prompt(s) for s in self.running)
        while (self.waiting and not preempted and not evicted and budget > 0
               and len(self.running) < self.config.max_num_seqs):
            seq = self.waiting[0]
            hit = self._take_cached_prefix(seq)
            start = seq.num_computed
            n = min(seq.num_tokens - start, self.config.prefill_chunk_size, budget)
            if not (self.allocator.can_allocate(self._blocks_to_finish_prompt(seq) + committed)
                    and self._ensure_blocks(seq, start + n)):
                self._release(seq)  # the cached blocks it took go back, still cached
                break
            self.prefix_cache.count(seq, hit)
            committed += self._blocks_to_finish_prompt(seq)
            self.waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            prefills.append(ScheduledChunk(seq, start, start + n))
            budget -= n
        return SchedulerOutput(decodes, prefills, preempted, evicted)
