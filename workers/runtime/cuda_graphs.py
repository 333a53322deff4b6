"""CUDA graphs for decode-only steps: one graph per batch-size bucket, captured at start-up.

Small buckets get a second graph for long contexts, whose attention splits each context across more
programs (``split_decode``); a step takes it when a sequence's context passes ``short_context``.
A decode step of ``n`` sequences replays the graph of the smallest bucket >= n:
  1. the host fills persistent pinned buffers (token ids, positions, slots, lengths, block tables);
     rows n..bucket are padding: slot -1 (the KV write skips it) and length 0 (attention reads
     nothing and returns zeros), so a padded row never touches the cache;
  2. one ``non_blocking`` copy per buffer moves the bucket's rows into the static device buffers;
  3. the graph replays the whole model over them and copies the logits into one static output buffer,
     [max_batch, vocab] float32, shared by every graph: each graph's own logits are then a temporary of
     the shared memory pool (reused by the next capture) rather than a tensor kept per graph, which for a
     large vocabulary and many buckets would be gigabytes the KV pool's sizing never counted.
Sampling stays outside the graph. A batch past the largest bucket, any step with a prefill, and
steps with layer hooks run eagerly. Graphs need the kernel path (``TritonOps``): the torch path
reads lengths back to the host and cannot be captured.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, Protocol

import torch

from workers.runtime.attention import DecodeItem, KernelMeta, StepBatch
from workers.runtime.kernels.ops import TritonOps
from workers.runtime.kernels.split_decode import num_splits, short_context
from workers.runtime.kv_cache import PagedKVCache
from workers.runtime.model import DecoderModel

log = logging.getLogger(__name__)


def bucket_ladder(max_batch: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every 16 up to ``max_batch`` (which is always the last bucket)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return tuple(sorted(set(sizes)))


def graph_variants(buckets: tuple[int, ...], kv_heads: int, max_model_len: int,
                   block_size: int) -> list[tuple[int, int]]:
    """The (bucket, context bound) pairs captured: every bucket at ``max_model_len``, and small buckets
    also at ``short_context`` where the long bound splits the attention and the short one does not."""
    short = short_context(block_size)
    return [(b, bound) for b in buckets for bound in (
        (short, max_model_len)
        if max_model_len > short and num_splits(b, kv_heads, max_model_len, block_size) > 1
        else (max_model_len,))]


_FIELDS = ("ids", "positions", "slots", "lens", "tables")


class DecodeBuffers:
    """The static inputs of a decode bucket: device buffers, [max_batch] or [max_batch, width], and host
    mirrors (pinned on CUDA) that are filled through numpy views, so a step allocates no tensor."""

    def __init__(self, max_batch: int, width: int, block_size: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        pin = device.type == "cuda"

        def pair(*shape: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
            return (torch.zeros(shape, dtype=dtype, device=device),
                    torch.zeros(shape, dtype=dtype, pin_memory=pin))
        long, i32 = torch.long, torch.int32
        made = [pair(max_batch, dtype=long), pair(max_batch, dtype=long), pair(max_batch, dtype=long),
                pair(max_batch, dtype=i32), pair(max_batch, width, dtype=i32)]
        self.dev = dict(zip(_FIELDS, (d for d, _ in made)))
        self.host = dict(zip(_FIELDS, (h for _, h in made)))
        self.dev["slots"].fill_(-1)  # what capture runs over: padding only
        self._np = {name: t.numpy() for name, t in self.host.items()}
        self._rows = torch.arange(max_batch, device=device)
        # Per row: the block table last written there and how many of its entries. Tables only grow by
        # appending (``Sequence.block_table``), so a row holding the same list needs only its new entries.
        self._tables: list[tuple[list[int] | None, int]] = [(None, 0)] * max_batch

    def batch(self, b: int, max_context: int) -> StepBatch:
        """The step metadata over the first ``b`` rows of the device buffers, for contexts of at most
        ``max_context`` tokens."""
        d = self.dev
        return StepBatch(input_ids=d["ids"][:b], positions=d["positions"][:b], slot_mapping=d["slots"][:b],
                         num_decode=b, decode_slots=None, decode_mask=None, prefills=(),
                         logits_indices=self._rows[:b], embed_indices=None, embeds=None,
                         kernel=KernelMeta(d["tables"][:b], d["lens"][:b], None, max_context))

    def stage(self, decodes: list[DecodeItem], bucket: int) -> None:
        """Fill rows [0, len(decodes)) from ``decodes`` and rows up to ``bucket`` with padding (token 0,
        slot -1, length 0), then copy the bucket's rows to the device (``non_blocking``)."""
        n = len(decodes)
        bs = self.block_size
        ids, pos, slots, lens, tables = (self._np[k] for k in _FIELDS)
        width = tables.shape[1]
        written = self._tables
        for i, d in enumerate(decodes):
            table = d.block_table
            ids[i] = d.token_id
            pos[i] = d.position
            slots[i] = table[d.position // bs] * bs + d.position % bs
            lens[i] = d.position + 1
            used = min(len(table), width)
            held, done = written[i]
            if held is not table:
                done = 0
            if used > done:
                tables[i, done:used] = table[done:used]
            written[i] = (table, used)
        ids[n:bucket] = 0
        pos[n:bucket] = 0
        slots[n:bucket] = -1
        lens[n:bucket] = 0
        for name in _FIELDS:
            self.dev[name][:bucket].copy_(self.host[name][:bucket], non_blocking=True)


class Replayable(Protocol):
    def replay(self) -> None: ...


class EagerStandIn:
    """A captured graph's stand-in for tests without a GPU: ``replay`` runs the captured call again, over the
    same static buffers, into the same output tensor, so everything around the graphs (buckets, staging,
    padding, which graph a step takes, the logits' rows) runs as on a GPU."""

    def __init__(self, fn: Callable[[], torch.Tensor]) -> None:
        self._fn = fn
        self.out = fn()

    @torch.inference_mode()  # the output is an inference tensor, as the model made it
    def replay(self) -> None:
        out = self._fn()
        if out.data_ptr() != self.out.data_ptr():  # a call that writes its static output itself needs no copy
            self.out.copy_(out)


class ReplayEvent(Protocol):
    def synchronize(self) -> None: ...
    def elapsed_time(self, end: Any) -> float: ...


class WallEvent:
    """A stand-in replay's timer, with the part of ``torch.cuda.Event``'s interface ``replay_seconds`` uses."""

    def __init__(self) -> None:
        self.at = 0.0

    def record(self) -> None:
        self.at = time.perf_counter()

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: WallEvent) -> float:
        """Milliseconds from this event to ``end``, as ``torch.cuda.Event.elapsed_time`` gives them."""
        return (end.at - self.at) * 1e3


class DecodeGraphs:
    """The captured graphs of one engine (its model, cache and kernel ops). ``stand_in``: no capture, each
    graph an ``EagerStandIn`` (any device; for tests)."""

    def __init__(self, model: DecoderModel, cache: PagedKVCache, ops: TritonOps, max_batch: int,
                 max_model_len: int, stand_in: bool = False) -> None:
        if cache.device.type != "cuda" and not stand_in:
            raise ValueError("CUDA graphs need the cache on a CUDA device")
        self._stand_in = stand_in
        self.model, self.cache, self.ops = model, cache, ops
        self.buckets = bucket_ladder(max_batch)
        self.buffers = DecodeBuffers(self.buckets[-1], cache.blocks_for(max_model_len), cache.block_size,
                                     cache.device)
        self.max_model_len = max_model_len
        self.short_context = short_context(cache.block_size)
        self._variants = graph_variants(self.buckets, model.cfg.num_kv_heads, max_model_len, cache.block_size)
        self._graphs: dict[tuple[int, int], tuple[Replayable, torch.Tensor]] = {}
        self._logits: torch.Tensor | None = None  # [max_batch, vocab] float32: every graph's output
        self.capture_seconds = 0.0
        self.capture_error: str | None = None  # why capture failed (every step then runs eager)
        self.replays = 0  # decode steps served by a graph
        # Benchmarks set a list here: each replay then appends its (start, end) CUDA events, so the device time
        # of the graphs alone can be told from a step's wall time. None (the default) records nothing.
        self.replay_events: list[tuple[ReplayEvent, ReplayEvent]] | None = None

    @property
    def max_batch(self) -> int:
        return self.buckets[-1]

    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller ones reuse its memory pool. The static
        buffers hold padding (slot -1, length 0) during capture, so it writes nothing to the cache.

        The warm-up before it runs every variant eagerly: a kernel that fails there raises. A capture that
        fails (CUDA refusing an operation while capturing) drops every graph and is logged as an error with
        its reason, kept in ``capture_error``: decode steps then run eager, as with ``cuda_graphs`` off."""
        start = time.perf_counter()
        if not self._stand_in:
            self._warm_up()
        try:
            self._capture_all()
        except Exception as e:  # noqa: BLE001  # whatever CUDA or Triton raised: named in the log and kept
            self._graphs.clear()
            self.capture_error = f"{type(e).__name__}: {e}"
            log.error("CUDA graph capture failed, decode steps run eager: %s", self.capture_error)
        self.capture_seconds = time.perf_counter() - start

    def _warm_up(self) -> None:
        """Every variant once on a side stream, outside any capture: Triton compiles and loads its kernels."""
        stream = torch.cuda.Stream(self.cache.device)
        stream.wait_stream(torch.cuda.current_stream(self.cache.device))
        with torch.cuda.stream(stream):
            for b, bound in self._variants:
                self.model(self.buffers.batch(b, bound), self.cache, None, self.ops)
        torch.cuda.current_stream(self.cache.device).wait_stream(stream)

    def _forward(self, b: int, bound: int) -> torch.Tensor:
        """The captured call: the model over bucket ``b``'s static buffers, its logits copied into the shared
        output's first ``b`` rows (returned)."""
        assert self._logits is not None
        out = self._logits[:b]
        out.copy_(self.model(self.buffers.batch(b, bound), self.cache, None, self.ops))
        return out

    def _capture_all(self) -> None:
        # outside the graphs' pool, before any capture
        self._logits = torch.empty(self.max_batch, self.model.cfg.vocab_size, dtype=torch.float32,
                                   device=self.cache.device)
        if self._stand_in:
            for b, bound in reversed(self._variants):
                stand_in = EagerStandIn(functools.partial(self._forward, b, bound))
                self._graphs[(b, bound)] = (stand_in, stand_in.out)
            return
        pool = torch.cuda.graph_pool_handle()
        # a capture stream on the cache's device: torch.cuda.graph's default one is made once per process,
        # on whatever device was current at the first capture (two engines on two GPUs would share it)
        stream = torch.cuda.Stream(self.cache.device)
        for b, bound in reversed(self._variants):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=stream):
                logits = self._forward(b, bound)
            self._graphs[(b, bound)] = (graph, logits)
        torch.cuda.synchronize(self.cache.device)

    def bucket_for(self, n: int) -> int | None:
        """The smallest bucket holding ``n`` sequences, or None (past the largest, or no graph captured: run
        eager)."""
        if self.capture_error is not None:
            return None
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
        self.buffers.stage(decodes, bucket)
        longest = max(d.position for d in decodes) + 1
        short = (bucket, self.short_context)
        graph, logits = self._graphs[short] if longest <= self.short_context and short in self._graphs else \
            self._graphs[(bucket, self.max_model_len)]
        if self.replay_events is None:
            graph.replay()
        else:
            self._timed_replay(graph, self.replay_events)
        self.replays += 1
        return logits[:len(decodes)]

    def _timed_replay(self, graph: Replayable, events: list[tuple[ReplayEvent, ReplayEvent]]) -> None:
        if self._stand_in:  # no CUDA: the wall time of the eager stand-in
            begun, ended = WallEvent(), WallEvent()
            begun.record()
            graph.replay()
            ended.record()
            events.append((begun, ended))
            return
        stream = torch.cuda.current_stream(self.cache.device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(stream)
        graph.replay()
        end.record(stream)
        events.append((start, end))

    def replay_seconds(self) -> float | None:
        """Mean device seconds of the replays ``replay_events`` recorded (synchronising with the last), or None
        when it recorded none."""
        events = self.replay_events
        if not events:
            return None
        events[-1][1].synchronize()
        return sum(start.elapsed_time(end) for start, end in events) / len(events) / 1e3
