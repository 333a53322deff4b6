"""CUDA graphs for decode-only steps: one graph per batch-size bucket, captured at start-up.

A decode step of ``n`` sequences replays the graph of the smallest bucket >= n:
  1. the host fills persistent pinned buffers (token ids, positions, slots, lengths, block tables);
     rows n..bucket are padding: slot -1 (the KV write skips it) and length 0 (attention reads
     nothing and returns zeros), so a padded row never touches the cache;
  2. one ``non_blocking`` copy per buffer moves the bucket's rows into the static device buffers;
  3. the graph replays the whole model over them; logits [n, vocab] float32 are read from its output.
Sampling stays outside the graph. A batch past the largest bucket, any step with a prefill, and
steps with layer hooks run eagerly. Graphs need the kernel path (``TritonOps``): the torch path
reads lengths back to the host and cannot be captured.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from workers.runtime.attention import DecodeItem, KernelMeta, StepBatch
from workers.runtime.kernels.ops import TritonOps
from workers.runtime.kv_cache import PagedKVCache
from workers.runtime.model import DecoderModel

log = logging.getLogger(__name__)


def bucket_ladder(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (which is always the last bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return tuple(sorted(set(sizes)))


@dataclass
class _Buffers:
    """Static device buffers and their pinned host mirrors, [max_batch] or [max_batch, width]."""

    ids: torch.Tensor
    positions: torch.Tensor
    slots: torch.Tensor
    lens: torch.Tensor
    tables: torch.Tensor

    @classmethod
    def make(cls, max_batch: int, width: int, device: torch.device, pin: bool) -> "_Buffers":
        def z(*shape: int, dtype: torch.dtype) -> torch.Tensor:
            return torch.zeros(shape, dtype=dtype, device=device, pin_memory=pin)
        return cls(z(max_batch, dtype=torch.long), z(max_batch, dtype=torch.long), z(max_batch, dtype=torch.long).fill_(-1),
                   z(max_batch, dtype=torch.int32), z(max_batch, width, dtype=torch.int32))


class DecodeGraphs:
    """The captured graphs of one engine (its model, cache and kernel ops)."""

    def __init__(self, model: DecoderModel, cache: PagedKVCache, ops: TritonOps, max_batch: int,
                 max_model_len: int) -> None:
        if cache.device.type != "cuda":
            raise ValueError("CUDA graphs need the cache on a CUDA device")
        self.model, self.cache, self.ops = model, cache, ops
        self.buckets = bucket_ladder(max_batch)
        width = cache.blocks_for(max_model_len)
        self._dev = _Buffers.make(self.buckets[-1], width, cache.device, pin=False)
        self._host = _Buffers.make(self.buckets[-1], width, torch.device("cpu"), pin=True)
        # numpy views of the pinned buffers: filling them allocates no tensor
        self._np = {name: getattr(self._host, name).numpy() for name in ("ids", "positions", "slots", "lens", "tables")}
        self._rows = torch.arange(self.buckets[-1], device=cache.device)
        self._graphs: dict[int, tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_seconds = 0.0
        self.replays = 0  # decode steps served by a graph

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def _batch(self, b: int) -> StepBatch:
        d = self._dev
        return StepBatch(input_ids=d.ids[:b], positions=d.positions[:b], slot_mapping=d.slots[:b], num_decode=b,
                         decode_slots=None, decode_mask=None, prefills=(), logits_indices=self._rows[:b],
                         embed_indices=None, embeds=None, kernel=KernelMeta(d.tables[:b], d.lens[:b], None))

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool. The static
        buffers hold padding (slot -1, length 0) during capture, so it writes nothing to the cache."""
        start = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):  # warm-up: compiles the Triton kernels outside any capture
            for b in self.buckets:
                self.model(self._batch(b), self.cache, None, self.ops)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)
        for b in reversed(self.buckets):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                logits = self.model(self._batch(b), self.cache, None, self.ops)
            self._graphs[b] = (graph, logits)
        torch.cuda.synchronize(self.cache.device)
        self.capture_seconds = time.perf_counter() - start

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` sequences, or None (past the largest: run eager)."""
        for b in self.buckets:
            if b >= n:
                return b
        log.debug("decode batch of %d is past the largest CUDA graph bucket (%d): running eager", n, self.max_batch)
        return None

    def run(self, decodes: list[DecodeItem], bucket: int) -> torch.Tensor:
        """Logits [len(decodes), vocab] float32 of one decode step, by replaying ``bucket``'s graph.
        The result is a view of the graph's output: valid until the next replay. The caller must
        have synchronised with the previous step (sampling reads its logits back), since this
        overwrites the pinned buffers the previous step's copies read from."""
        n = len(decodes)
        bs = self.cache.block_size
        ids, pos, slots, lens, tables = (self._np[k] for k in ("ids", "positions", "slots", "lens", "tables"))
        width = tables.shape[1]
        for i, d in enumerate(decodes):
            ids[i] = d.token_id
            pos[i] = d.position
            slots[i] = d.block_table[d.position // bs] * bs + d.position % bs
            lens[i] = d.position + 1
            used = min(len(d.block_table), width)
            tables[i, :used] = d.block_table[:used]
        ids[n:bucket] = 0
        pos[n:bucket] = 0
        slots[n:bucket] = -1
        lens[n:bucket] = 0
        for name in ("ids", "positions", "slots", "lens", "tables"):
            getattr(self._dev, name)[:bucket].copy_(getattr(self._host, name)[:bucket], non_blocking=True)
        graph, logits = self._graphs[bucket]
        graph.replay()
        self.replays += 1
        return logits[:n]
