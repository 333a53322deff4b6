"""The engine: the model, its paged KV cache and the scheduler, driven one step at a time.

A request's life in the engine:
  1. ``add_request`` validates it (ids, context length, pool capacity) before allocating anything,
     or raises an ``EngineError``.
  2. Each ``step`` schedules a batch, runs the model once over it, samples, applies stop rules and
     returns one ``RequestOutput`` per sequence that produced a token or finished.
  3. On finish or ``abort`` the sequence's blocks return to the pool.
A disaggregated decode worker skips 1-2 for the prompt: ``reserve`` takes blocks for a prompt whose
KV will arrive over the wire, and ``add_prefilled`` joins it to the batch with the first token that
prefill sampled (or ``release`` gives the blocks back if the transfer fails).

One thread drives ``step``; the request methods may be called from other threads (a lock orders
them against the scheduling part of a step). Layer hooks see each layer's k/v as soon as it is in
the cache, which is what the KV transfer streams from.
"""

from __future__ import annotations

import logging
import random
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Literal

import torch

from workers.runtime.attention import DecodeItem, PrefillItem, build_step_batch
from workers.runtime.devices import on_device
from workers.runtime.errors import (
    CapacityError,
    DuplicateRequestError,
    EngineError,
    InvalidRequestError,
    PromptTooLongError,
    RecomputeError,
    RequestTooLargeError,
)
from workers.runtime.kv_cache import CACHE_DTYPES, CacheDType, KVCacheSpec, PagedKVCache
from workers.runtime.model import DecoderModel
from workers.runtime.prefix_cache import PrefixCache
from workers.runtime.sampler import SamplingParams, TokenLogprobs, sample, seed_draw, token_logprobs
from workers.runtime.scheduler import ScheduledChunk, Scheduler, SchedulerConfig
from workers.runtime.sequence import FinishReason, MultimodalInput, Sequence
from workers.runtime.tokenizer import IncrementalDetokenizer, Tokenizer
from workers.runtime.warmup import WarmupShapes, warm_up

if TYPE_CHECKING:
    from workers.runtime.cuda_graphs import DecodeGraphs
    from workers.runtime.kernels.ops import TritonOps

DTypeName = Literal["float32", "bfloat16"]
KernelsMode = Literal["auto", "torch", "triton"]
DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16}
DEFAULT_KV_CACHE_BYTES = 256 * 2**20
# Prompt logprobs: the logits of this many prompt positions at a time ([rows, vocab] float32: 78 MiB for a
# 152k vocabulary), however long the prefill chunk
PROMPT_LOGITS_ROWS = 128
PREEMPTION_WARNING_EVERY_S = 60.0
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class EngineConfig:
    dtype: DTypeName = "float32"
    device: str = "cpu"
    block_size: int = 16
    # None = DEFAULT_KV_CACHE_BYTES on CPU; on CUDA, sized from free memory (gpu_memory_utilization)
    kv_cache_bytes: int | None = None
    kv_cache_dtype: Literal["auto"] | CacheDType = "auto"  # auto = the model dtype
    kv_layer_dtypes: tuple[CacheDType, ...] | None = None  # per layer, overriding kv_cache_dtype
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    prefill_chunk_size: int = 512
    max_model_len: int | None = None  # None = the model's max_position_embeddings
    seed: int = 0  # seeds unseeded sampling, so a whole run is reproducible
    # auto = the Triton kernels on CUDA (when triton is installed), the torch path elsewhere
    kernels: KernelsMode = "auto"
    cuda_graphs: bool = True  # decode steps replay one CUDA graph per batch bucket (CUDA + kernels only)
    cuda_graph_max_batch: int | None = None  # the largest bucket (None = max_num_seqs); larger steps run eager
    gpu_memory_utilization: float = 0.9  # of the device's total memory, when kv_cache_bytes is None
    # a KV reservation (disaggregated decode) leaves free this many more tokens' blocks per sequence here
    # (fewer for one whose max_tokens is nearer): see Engine.reserve
    decode_headroom_tokens: int = 256
    # a worker runs Engine.warm_up() before it serves (its largest steps once, so memory does not step up later)
    warmup: bool = False
    # reuse the KV of cached prompt prefixes (full blocks; workers.runtime.prefix_cache), as vLLM and SGLang do
    prefix_caching: bool = True

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise InvalidRequestError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.kv_cache_dtype != "auto" and self.kv_cache_dtype not in CACHE_DTYPES:
            raise InvalidRequestError(
                f"kv_cache_dtype must be auto or one of {', '.join(CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")
        for d in self.kv_layer_dtypes or ():
            if d not in CACHE_DTYPES:
                raise InvalidRequestError(f"kv_layer_dtypes: unknown dtype {d!r}; one of {', '.join(CACHE_DTYPES)}")
        if self.kernels not in ("auto", "torch", "triton"):
            raise InvalidRequestError(f"kernels must be auto, torch or triton, got {self.kernels!r}")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes <= 0:
            raise InvalidRequestError(f"kv_cache_bytes must be positive, got {self.kv_cache_bytes}")
        if self.cuda_graph_max_batch is not None and self.cuda_graph_max_batch < 1:
            raise InvalidRequestError(f"cuda_graph_max_batch must be >= 1, got {self.cuda_graph_max_batch}")
        if self.decode_headroom_tokens < 0:
            raise InvalidRequestError(f"decode_headroom_tokens must be >= 0, got {self.decode_headroom_tokens}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequestError(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization!r}")

    def scheduler_config(self) -> SchedulerConfig:
        return SchedulerConfig(self.max_num_seqs, self.max_num_batched_tokens, self.prefill_chunk_size)


@dataclass(frozen=True)
class RequestOutput:
    """What one step produced for one request. ``text`` is the new text since the last output."""

    request_id: str
    new_token_ids: tuple[int, ...]
    text: str
    finished: bool
    finish_reason: FinishReason | None
    num_prompt_tokens: int
    num_output_tokens: int
    logits: torch.Tensor | None = None  # [vocab] float32, when params.return_logits
    logprobs: TokenLogprobs | None = None  # the new token's, when params.logprobs is set
    # On a sequence's first output, when params.prompt_logprobs is set and this engine prefilled the prompt:
    # each prompt token's after the first, in order
    prompt_logprobs: tuple[TokenLogprobs, ...] | None = None
    # On a finished output handed out by workers.engine_loop.EngineLoop: seconds from the request's
    # admission to this output (the steps that ran it and the gaps between them); 0.0 otherwise.
    engine_seconds: float = 0.0
    # On a finished (ABORT) output: why the engine ended the request itself (a RecomputeError: evicted)
    error: EngineError | None = None


@dataclass(frozen=True)
class ChunkRef:
    """Tokens [start, end) of ``request_id`` whose k/v a layer has just written into ``blocks``."""

    request_id: str
    blocks: tuple[int, ...]
    start: int
    end: int
    last: bool  # the prompt's final chunk


@dataclass(frozen=True)
class LayerKVReady:
    layer: int
    chunks: tuple[ChunkRef, ...]


LayerHook = Callable[[LayerKVReady], None]


@dataclass(frozen=True)
class KVReservation:
    """Blocks held for a prompt whose KV will be written from outside the engine (a KV transfer)."""

    request_id: str
    num_tokens: int
    blocks: tuple[int, ...]
    max_new_tokens: int = 0  # the request's max_tokens: how far its sequence may grow once adopted
    # the prompt's first multimodal placeholder, whose KV comes from an image this engine never sees (None:
    # no image): the prefix cache keeps only the blocks before it
    first_image_position: int | None = None
    # the first ``cached_blocks`` of ``blocks`` came from the prefix cache, holding their KV already: the
    # transfer sends only the blocks after them
    cached_blocks: int = 0


@dataclass
class EngineStats:
    num_waiting: int
    num_running: int
    blocks_total: int
    blocks_free: int
    num_preemptions: int = 0
    steps: int = 0
    num_reservations: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache (admissions, counted again)
    prefix_cache_hits: int = 0  # of which their KV was cached
    cached_blocks: int = 0  # blocks in the prefix cache's index, held or evictable (counted in blocks_free)


class Engine:
    def __init__(self, model: DecoderModel, tokenizer: Tokenizer | None, config: EngineConfig = EngineConfig(),
                 eos_token_ids: tuple[int, ...] = ()) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        cfg = model.cfg
        self.eos_token_ids = frozenset(eos_token_ids or cfg.eos_token_ids)
        self.max_model_len = min(config.max_model_len or cfg.max_position_embeddings, cfg.max_position_embeddings)
        cache_dtype = config.dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype
        layer_dtypes = config.kv_layer_dtypes or (cache_dtype,) * cfg.num_layers
        if len(layer_dtypes) != cfg.num_layers:
            raise InvalidRequestError(f"kv_layer_dtypes names {len(layer_dtypes)} layers; the model has "
                                      f"{cfg.num_layers}")
        spec = KVCacheSpec(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, config.block_size)
        self._ops = _kernel_ops(config, model.device)
        self.graphs: DecodeGraphs | None = None
        with on_device(model.device):  # Triton launches and graph capture follow the current device
            budget = config.kv_cache_bytes
            if budget is None and model.device.type == "cuda":
                from workers.runtime.gpu_memory import kv_budget_from_free_memory

                budget = kv_budget_from_free_memory(model, spec, layer_dtypes, config.gpu_memory_utilization,
                                                    min(config.max_num_batched_tokens, self.max_model_len), self._ops,
                                                    config.max_num_seqs)
            self.cache = PagedKVCache.from_budget(spec, budget or DEFAULT_KV_CACHE_BYTES, layer_dtypes, model.device,
                                                  read_dtype=model.dtype)
            self.prefix_cache = PrefixCache(self.cache.allocator, config.block_size, config.prefix_caching)
            self.scheduler = Scheduler(config.scheduler_config(), self.cache.allocator, config.block_size,
                                       self.prefix_cache)
            if self.cache.num_blocks * config.block_size < self.max_model_len:
                log.warning("the KV pool holds %d tokens, fewer than the model's context of %d: a request that "
                            "needs more is refused (context_length_exceeded), one without max_tokens stops where "
                            "the pool ends; give the pool more room (engine.kv_cache_bytes, or "
                            "gpu_memory_utilization on CUDA)", self.cache.num_blocks * config.block_size,
                            self.max_model_len)
            if self._ops is not None and config.cuda_graphs and model.device.type == "cuda":
                from workers.runtime.cuda_graphs import DecodeGraphs

                max_batch = min(config.cuda_graph_max_batch or config.max_num_seqs, config.max_num_seqs)
                self.graphs = DecodeGraphs(model, self.cache, self._ops, max_batch, self.max_model_len)
                self.graphs.capture()
                if self.graphs.capture_error is None:  # a failed capture has logged its own error
                    log.info("captured %d decode CUDA graphs (batch buckets up to %d) in %.2f s",
                             len(self.graphs.buckets), self.graphs.max_batch, self.graphs.capture_seconds)
        self._seqs: dict[str, Sequence] = {}
        self._rng = random.Random(config.seed)
        self._hooks: list[LayerHook] = []
        self._preemptions = 0
        self._preempt_warned_at = -float("inf")
        self._steps = 0
        self._reservations: dict[str, KVReservation] = {}
        self._lock = threading.RLock()

    def warm_up(self) -> WarmupShapes:
        """Run the largest prefill and decode steps once, before serving, so the allocator's peak is
        reached at start-up (workers.runtime.warmup). Changes no later output. Call with no request in."""
        cfg = self.config
        with self._lock:
            if self.scheduler.has_work() or self._reservations:
                raise RuntimeError("warm_up runs before the engine serves: it holds requests or blocks")
            with on_device(self.model.device):
                shapes = warm_up(self.model, self.cache, self._ops, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                 prefill_chunk_size=cfg.prefill_chunk_size, max_num_seqs=cfg.max_num_seqs,
                                 max_model_len=self.max_model_len)
        log.info("warm-up: prefill chunks %s (first after %d tokens), decode %d x %d tokens, in %.2f s",
                 shapes.prefill_chunks, shapes.prefill_context, shapes.decode_seqs, shapes.decode_context,
                 shapes.seconds)
        return shapes

    # ------------------------------------------------------------------ requests
    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                    mm: MultimodalInput | None = None) -> None:
        """Queue a request, or raise an ``EngineError`` naming what is wrong; nothing is allocated."""
        with self._lock:
            seq = self._new_sequence(request_id, prompt_ids, params, mm)
            self._seqs[request_id] = seq
            self.scheduler.add(seq)

    def _new_sequence(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
                      mm: MultimodalInput | None) -> Sequence:
        if request_id in self._seqs or request_id in self._reservations:
            raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
        params = self.fit(len(prompt_ids), params)
        self.check_request(prompt_ids, params, mm)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(self.tokenizer, params.stop, prompt_ids=prompt_ids)
        return Sequence(request_id, list(prompt_ids), params, seed, time.monotonic(), mm, detok)

    def fit(self, prompt_len: int, params: SamplingParams) -> SamplingParams:
        """``params`` with a ``to_context`` ceiling lowered to what this engine holds after the prompt: its
        context and its KV pool (a pool smaller than the model's context would otherwise refuse every
        request that did not set max_tokens). Anything else is returned as it is."""
        if not params.to_context:
            return params
        room = min(self.max_model_len, self.cache.num_blocks * self.cache.block_size) - prompt_len
        return replace(params, max_tokens=room) if 1 <= room < params.max_tokens else params

    def check_request(self, prompt_ids: list[int], params: SamplingParams, mm: MultimodalInput | None = None) -> None:
        """Raise the EngineError this request would get, without queueing or allocating anything."""
        params = self.fit(len(prompt_ids), params)
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty")
        vocab = self.model.cfg.vocab_size
        if min(prompt_ids) < 0 or max(prompt_ids) >= vocab:
            raise InvalidRequestError(f"prompt token ids must be in [0, {vocab})")
        total = len(prompt_ids) + params.max_tokens
        if total > self.max_model_len:
            raise PromptTooLongError(
                f"this model's context is {self.max_model_len} tokens; the request needs {total} "
                f"({len(prompt_ids)} prompt + {params.max_tokens} max_tokens)")
        if self.cache.blocks_for(total) > self.cache.num_blocks:
            raise RequestTooLargeError(
                f"the request needs KV cache for {total} tokens ({len(prompt_ids)} prompt + {params.max_tokens} "
                f"max_tokens), more than a worker's KV pool holds ({self.cache.num_blocks * self.cache.block_size} "
                f"tokens, though the model's context is {self.max_model_len}): lower max_tokens or shorten the "
                f"prompt (an operator gives the pool more room: engine.kv_cache_bytes, or gpu_memory_utilization "
                f"on CUDA)")
        if mm is not None:
            self._check_mm(prompt_ids, mm)

    # ------------------------------------------------------------------ disaggregated decode
    def reserve(self, request_id: str, num_tokens: int, max_new_tokens: int = 0,
                first_image_position: int | None = None, prompt_ids: list[int] | None = None) -> KVReservation:
        """Hold blocks for ``num_tokens`` prompt tokens whose KV another worker will send, for a request that
        may generate ``max_new_tokens`` (``first_image_position``: see ``KVReservation``). Given the prompt's
        ``prompt_ids``, the blocks of its longest prefix in the prefix cache are taken as they are (the
        reservation's ``cached_blocks``: their KV need not be sent) and the rest freshly.

        Raises CapacityError when the blocks are not free now, or when taking them would leave too little
        for the sequences here to grow: ``decode_headroom_tokens`` more tokens each (fewer for one nearer its
        max_tokens) for every running sequence, every reservation and this one, and no reservation at all
        while a preempted sequence waits for its blocks back. Without that headroom a new request's KV
        would take the blocks a running sequence needs for its next token, and that sequence would be
        preempted: it then waits until all of its blocks are free again and recomputes its whole context
        here, silent for seconds (as SGLang's decode keeps ``num_reserved_decode_tokens`` per request).
        The caller may retry or queue. With nothing else here, a request that passed ``check_request``
        always fits."""
        with self._lock:
            if request_id in self._seqs or request_id in self._reservations:
                raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
            if not 0 < num_tokens < self.max_model_len:
                raise PromptTooLongError(f"cannot reserve {num_tokens} tokens: this model's context is "
                                         f"{self.max_model_len} tokens")
            if self.scheduler.waiting:
                raise CapacityError(f"{len(self.scheduler.waiting)} preempted sequences wait for KV blocks here")
            if prompt_ids is not None and len(prompt_ids) != num_tokens:
                raise InvalidRequestError(f"{len(prompt_ids)} prompt token ids for a reservation of {num_tokens}")
            need = self.cache.blocks_for(num_tokens)
            keep = self._headroom_blocks() + self._growth_blocks(num_tokens, num_tokens + max_new_tokens, need)
            allocator = self.cache.allocator
            hit = [] if prompt_ids is None else self.prefix_cache.match_prompt(
                prompt_ids, sys.maxsize if first_image_position is None else first_image_position)
            allocator.take(hit)  # before counting what is free: an evictable hit stops being free
            free = allocator.num_free
            if need - len(hit) + keep > free:
                allocator.free(hit)
                raise CapacityError(f"need {need - len(hit)} KV blocks for the prompt and {keep} left free for the "
                                    f"sequences here to grow; {free} free of {self.cache.num_blocks}")
            blocks = tuple(hit) + tuple(allocator.allocate(need - len(hit)))
            if prompt_ids is not None:
                self.prefix_cache.count_tokens(num_tokens, len(hit))
            res = KVReservation(request_id, num_tokens, blocks, max_new_tokens, first_image_position, len(hit))
            self._reservations[request_id] = res
            return res

    def without_cached(self, reservation: KVReservation,
                       retarget: Callable[[tuple[int, ...]], bool]) -> KVReservation:
        """``reservation`` with fresh blocks in place of its cached ones, for a sender that sends every block.
        ``retarget(blocks)`` points the expected push at the new blocks; when it says False (a push already
        streams), or no block is free (CapacityError), nothing changes. The reservation must be live."""
        with self._lock:
            if self._reservations.get(reservation.request_id) is not reservation:
                raise InvalidRequestError(f"no live reservation for request {reservation.request_id!r}")
            k = reservation.cached_blocks
            if not k:
                return reservation
            fresh = self.cache.allocator.allocate(k)
            blocks = tuple(fresh) + reservation.blocks[k:]
            if not retarget(blocks):
                self.cache.allocator.free(fresh)
                return reservation
            self.cache.allocator.free(list(reservation.blocks[:k]))
            swapped = replace(reservation, blocks=blocks, cached_blocks=0)
            self._reservations[reservation.request_id] = swapped
            return swapped

    def _growth_blocks(self, tokens: int, max_tokens: int, held: int) -> int:
        """Blocks beyond ``held`` a sequence of ``tokens`` tokens needs to grow by the headroom (to at most
        ``max_tokens`` in all)."""
        grown = min(max_tokens, tokens + self.config.decode_headroom_tokens)
        return max(0, self.cache.blocks_for(grown) - held)

    def _headroom_blocks(self) -> int:
        """The blocks every running sequence and every reservation here may take to grow by the headroom."""
        running = sum(self._growth_blocks(s.num_tokens, len(s.prompt_ids) + s.params.max_tokens, len(s.block_table))
                      for s in self.scheduler.running)
        return running + sum(self._growth_blocks(r.num_tokens, r.num_tokens + r.max_new_tokens, len(r.blocks))
                             for r in self._reservations.values())

    def release(self, reservation: KVReservation) -> bool:
        """Give back a reservation that was not adopted (transfer failed, aborted, timed out).
        Idempotent: returns False when it was already released or adopted."""
        with self._lock:
            if self._reservations.get(reservation.request_id) is not reservation:
                return False
            del self._reservations[reservation.request_id]
            self.cache.allocator.free(list(reservation.blocks))
            return True

    def add_prefilled(self, reservation: KVReservation, prompt_ids: list[int], first_token: int,
                      params: SamplingParams, first_logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """Join a sequence whose prompt KV is already in the reserved blocks, with the first token
        prefill sampled (and its logprobs, computed there). Returns that token's output (which may already
        finish the request). Its full blocks before the reservation's ``first_image_position`` join the prefix
        cache.

        The reservation is consumed whether this succeeds or raises."""
        with self._lock:
            if self._reservations.get(reservation.request_id) is not reservation:
                raise InvalidRequestError(f"no live reservation for request {reservation.request_id!r}")
            del self._reservations[reservation.request_id]
            try:
                if len(prompt_ids) != reservation.num_tokens:
                    raise InvalidRequestError(f"{len(prompt_ids)} prompt tokens for a reservation of "
                                              f"{reservation.num_tokens}")
                if params.forced_tokens:
                    first_token = params.forced_tokens[0]
                if not 0 <= first_token < self.model.cfg.vocab_size:
                    raise InvalidRequestError(f"first token {first_token} is outside the vocabulary")
                seq = self._new_sequence(reservation.request_id, prompt_ids, params, None)
            except Exception:
                self.cache.allocator.free(list(reservation.blocks))
                raise
            seq.block_table = list(reservation.blocks)
            seq.num_computed = len(prompt_ids)
            if reservation.first_image_position is not None:
                seq.cacheable_tokens = reservation.first_image_position
                seq.recomputable = False
            self.prefix_cache.register(seq)
            self._seqs[seq.request_id] = seq
            self.scheduler.adopt(seq)
            return self._append(seq, first_token, None, first_logprobs)

    def _check_mm(self, prompt_ids: list[int], mm: MultimodalInput) -> None:
        if mm.embeds.ndim != 2 or mm.embeds.shape[1] != self.model.cfg.hidden_size:
            raise InvalidRequestError(
                f"multimodal embeddings must be [n, {self.model.cfg.hidden_size}], got {tuple(mm.embeds.shape)}")
        if mm.embeds.shape[0] != len(mm.positions):
            raise InvalidRequestError(
                f"{mm.embeds.shape[0]} embeddings for {len(mm.positions)} placeholder positions")
        if list(mm.positions) != sorted(set(mm.positions)) or (
                mm.positions and not 0 <= mm.positions[0] <= mm.positions[-1] < len(prompt_ids)):
            raise InvalidRequestError("placeholder positions must be distinct, ascending and inside the prompt")

    def abort(self, request_id: str) -> bool:
        """Drop a request (or an unadopted reservation) and free its blocks. Returns False if it is
        unknown or already finished."""
        with self._lock:
            res = self._reservations.get(request_id)
            if res is not None:
                return self.release(res)
            seq = self._seqs.pop(request_id, None)
            if seq is None:
                return False
            self.scheduler.finish(seq, FinishReason.ABORT)
            return True

    def has_unfinished(self) -> bool:
        with self._lock:
            return self.scheduler.has_work()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix; returns how many blocks were indexed. Blocks held by running sequences
        stay theirs, unindexed, and the blocks they complete from now on are not indexed either (their chain
        starts in blocks the index no longer has)."""
        with self._lock:
            for seq in self.scheduler.running:
                seq.num_registered = sys.maxsize
            return self.cache.allocator.reset_prefix_cache()

    def add_layer_hook(self, hook: LayerHook) -> None:
        self._hooks.append(hook)

    def remove_layer_hook(self, hook: LayerHook) -> None:
        self._hooks.remove(hook)

    def stats(self) -> EngineStats:
        """Read without the engine's lock, so a status call never waits for a step in flight (one may take
        long: a prefill layer hook waiting for transfer budget, a kernel's first compile). Each number is
        current when read; together they may straddle a step."""
        hits = self.prefix_cache.hit_tokens  # read before the queries, which count first: hits <= queries
        return EngineStats(len(self.scheduler.waiting), len(self.scheduler.running), self.cache.num_blocks,
                           self.cache.allocator.num_free, self._preemptions, self._steps,
                           num_reservations=len(self._reservations),
                           prefix_cache_hits=hits, prefix_cache_queries=self.prefix_cache.queried_tokens,
                           cached_blocks=self.cache.allocator.num_cached)

    def _warn_preempted(self, n: int) -> None:
        """One warning for the first preemption, then at most one a minute with the count since start."""
        now = time.monotonic()
        if now - self._preempt_warned_at < PREEMPTION_WARNING_EVERY_S:
            return
        self._preempt_warned_at = now
        log.warning("%d sequence(s) preempted (%d since start): the KV pool had no block for their next token. A "
                    "preempted sequence sends nothing until all of its blocks are free again, then recomputes its "
                    "context. Give the pool more room (engine.kv_cache_bytes, or gpu_memory_utilization on CUDA), "
                    "or lower engine.max_num_seqs", n, self._preemptions)

    # ------------------------------------------------------------------ the step
    def step(self) -> list[RequestOutput]:
        with self._lock, on_device(self.model.device):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        plan = self.scheduler.schedule()
        if plan.preempted or plan.evicted:
            self._preemptions += len(plan.preempted) + len(plan.evicted)
            self._warn_preempted(len(plan.preempted) + len(plan.evicted))
        evicted = [self._evicted(s) for s in plan.evicted]
        if plan.empty:
            return evicted
        self._steps += 1
        decodes = [DecodeItem(s.output_ids[-1], s.num_computed, s.block_table) for s in plan.decodes]
        prefills = [self._prefill_item(c) for c in plan.prefills]
        bucket = self.graphs.bucket_for(len(decodes)) if self.graphs is not None and not prefills else None
        if bucket is not None:
            assert self.graphs is not None
            logits = self.graphs.run(decodes, bucket)
        else:
            batch = build_step_batch(decodes, prefills, self.cache, paged_kernels=self._ops is not None)
            hook = self._layer_hook(plan.prefills) if self._hooks and plan.prefills else None
            prompt_hidden: list[torch.Tensor] = []
            logits = self.model(batch, self.cache, hook, self._ops, prompt_hidden)
            if prompt_hidden:
                self._gather_prompt_logprobs(plan.prefills, prefills, prompt_hidden[0])

        for s in plan.decodes:
            s.num_computed += 1
            self.prefix_cache.register(s)
        for c in plan.prefills:
            c.seq.num_computed = c.end
            self.prefix_cache.register(c.seq)
        sampled = plan.decodes + [c.seq for c in plan.prefills if c.end == c.seq.num_tokens]
        for s in sampled:
            if not s.params.greedy:
                seed_draw(s.generator, s.seed, len(s.output_ids))
        tokens = sample(logits, [s.params for s in sampled], [s.generator for s in sampled])
        tokens = [s.params.forced_tokens[len(s.output_ids)] if s.params.forced_tokens else t
                  for s, t in zip(sampled, tokens)]
        logprobs = token_logprobs(logits, tokens, [s.params.logprobs for s in sampled])
        return evicted + [self._append(s, t, logits[i].clone() if s.params.return_logits else None, logprobs[i])
                          for i, (s, t) in enumerate(zip(sampled, tokens))]

    def _evicted(self, seq: Sequence) -> RequestOutput:
        """The finished output of a sequence the scheduler evicted (its blocks are already free)."""
        del self._seqs[seq.request_id]
        log.warning("request %s evicted after %d tokens: its KV pool had no block for it, and its context holds "
                    "image KV this worker cannot compute again", seq.request_id, len(seq.output_ids))
        error = RecomputeError(f"the decode worker's KV pool ran out of blocks and it cannot recompute request "
                               f"{seq.request_id!r}: its KV came from images this worker never saw; it must be "
                               f"prefilled again")
        return RequestOutput(seq.request_id, (), "", True, FinishReason.ABORT, len(seq.prompt_ids),
                             len(seq.output_ids), error=error)

    def _prefill_item(self, c: ScheduledChunk) -> PrefillItem:
        mm = c.seq.embeds_in(c.start, c.end)
        seq = c.seq
        prompt_rows = 0  # positions [start, len(prompt) - 1) give the next prompt token's logprobs
        if seq.params.prompt_logprobs is not None and not seq.output_ids:
            prompt_rows = max(0, min(c.end, len(seq.prompt_ids) - 1) - c.start)
        return PrefillItem(seq.tokens(c.start, c.end), c.start, seq.block_table,
                           want_logits=c.end == seq.num_tokens,
                           embed_offsets=mm[0] if mm else None, embeds=mm[1] if mm else None,
                           prompt_logits=prompt_rows)

    def _gather_prompt_logprobs(self, chunks: list[ScheduledChunk], items: list[PrefillItem],
                                hidden: torch.Tensor) -> None:
        """Each chunk's prompt logprobs from the final-normed ``hidden`` of its ``prompt_logits`` rows (in chunk
        order) onto its sequence, ``PROMPT_LOGITS_ROWS`` rows' logits at a time; a chunk from position 0 starts
        the list afresh (a prefill computed again after preemption)."""
        targets: list[int] = []
        wanted: list[int | None] = []
        for c, item in zip(chunks, items):
            if item.prompt_logits:
                if c.start == 0:
                    c.seq.prompt_logprobs = []
                targets.extend(c.seq.prompt_ids[c.start + 1:c.start + 1 + item.prompt_logits])
                wanted.extend([c.seq.params.prompt_logprobs] * item.prompt_logits)
        figures: list[TokenLogprobs | None] = []
        for a in range(0, len(targets), PROMPT_LOGITS_ROWS):
            b = a + PROMPT_LOGITS_ROWS
            figures.extend(token_logprobs(self.model.lm_logits(hidden[a:b]), targets[a:b], wanted[a:b]))
        it = iter(figures)
        for c, item in zip(chunks, items):
            c.seq.prompt_logprobs.extend(next(it) for _ in range(item.prompt_logits))  # type: ignore[misc]

    def _layer_hook(self, chunks: list[ScheduledChunk]) -> Callable[[int], None]:
        refs = tuple(ChunkRef(c.seq.request_id, tuple(c.seq.block_table), c.start, c.end,
                              c.end >= len(c.seq.prompt_ids)) for c in chunks)

        def on_layer_done(layer: int) -> None:
            event = LayerKVReady(layer, refs)
            for hook in self._hooks:
                hook(event)
        return on_layer_done

    def _append(self, seq: Sequence, token: int, logits: torch.Tensor | None,
                logprobs: TokenLogprobs | None = None) -> RequestOutput:
        seq.output_ids.append(token)
        params = seq.params
        reason: FinishReason | None = None
        text = ""
        if token in params.stop_token_ids or (token in self.eos_token_ids and not params.ignore_eos):
            reason = FinishReason.STOP
        elif seq.detok is not None:
            step = seq.detok.add(token)
            text = step.text
            if step.stopped:
                reason = FinishReason.STOP
        if reason is None and (len(seq.output_ids) >= params.max_tokens or seq.num_tokens >= self.max_model_len):
            reason = FinishReason.LENGTH
        if reason is not None:
            if seq.detok is not None and not seq.detok.stopped:
                text += seq.detok.flush()
            self.scheduler.finish(seq, reason)
            del self._seqs[seq.request_id]
        prompt_logprobs = None
        if len(seq.output_ids) == 1 and seq.params.prompt_logprobs is not None and (
                seq.prompt_logprobs or len(seq.prompt_ids) == 1):  # this engine prefilled the prompt
            prompt_logprobs, seq.prompt_logprobs = tuple(seq.prompt_logprobs), []
        return RequestOutput(seq.request_id, (token,), text, reason is not None, reason,
                             len(seq.prompt_ids), len(seq.output_ids), logits, logprobs, prompt_logprobs)


def _kernel_ops(config: EngineConfig, device: torch.device) -> TritonOps | None:
    """The Triton ops when ``config.kernels`` asks for them (or auto finds CUDA), else None (torch)."""
    from workers.runtime import kernels

    if config.kernels == "torch" or (config.kernels == "auto" and (device.type != "cuda" or not kernels.available())):
        return None
    if not kernels.available():
        raise InvalidRequestError("kernels=triton needs the triton package (pip install triton)")
    from workers.runtime.kernels.ops import TritonOps

    return TritonOps(config.block_size)
