"""The start-up warm-up: run the largest steps an engine will run before it serves (as vLLM's profile run).

A step's transient tensors (activations, the gathered context of the torch attention path, logits and
sampling buffers) grow with the batch. The allocator keeps what the largest step so far needed, so without
a warm-up a worker's resident memory steps up under load the first time a larger batch comes, which looks
like a leak in a soak. ``warm_up`` runs, once, with no request in the engine:

  1. a prefill step of ``max_num_batched_tokens`` tokens in chunks of ``prefill_chunk_size`` (the first
     chunk with the longest context the pool holds, so the context gather and its mask are at their
     largest; the others fresh);
  2. a decode step of ``max_num_seqs`` sequences, each at an equal share of the pool's tokens (all the
     pool's blocks in use at once), then sampling of every row (temperature 1, top-p).
The blocks it writes are taken from the pool and given back; no request, sequence, counter or random
generator of the engine is touched, so every later output is what it would have been without it.

glibc keeps freed memory per arena, and a thread takes an arena of its own while fewer than
``MALLOC_ARENA_MAX`` exist (8 per core by default). Steps run on the engine loop's thread and on gRPC
handler threads, not on the thread that warmed up, so the warm-up's peak covers them only when arenas are
few: pool replicas start with ``MALLOC_ARENA_MAX`` set (``{pool}.malloc_arena_max``, default 2).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.runtime.attention import DecodeItem, PrefillItem, build_step_batch
from workers.runtime.sampler import SamplingParams, sample

if TYPE_CHECKING:
    from workers.runtime.kernels.ops import TritonOps
    from workers.runtime.kv_cache import PagedKVCache
    from workers.runtime.model import DecoderModel


@dataclass(frozen=True)
class WarmupShapes:
    """What the warm-up ran: prefill chunk lengths (tokens), the context of the first chunk (tokens before
    it), the decode batch (sequences) and each decode's context (tokens)."""

    prefill_chunks: tuple[int, ...]
    prefill_context: int
    decode_seqs: int
    decode_context: int
    seconds: float


def warmup_shapes(max_num_batched_tokens: int, prefill_chunk_size: int, max_num_seqs: int, max_model_len: int,
                  pool_tokens: int) -> tuple[tuple[int, ...], int, int]:
    """(prefill chunk lengths, first chunk's context, decode context) for these limits; every length fits
    ``max_model_len`` and one shared block table of at most ``pool_tokens`` tokens."""
    span = min(max_model_len, pool_tokens)  # tokens the shared block table covers
    chunks: list[int] = []
    left = max_num_batched_tokens
    while left > 0 and len(chunks) < max_num_seqs:
        n = min(prefill_chunk_size, left, span)
        chunks.append(n)
        left -= n
    context = span - chunks[0]
    decode_context = max(1, min(span, pool_tokens // max_num_seqs))
    return tuple(chunks), context, decode_context


def warm_up(model: DecoderModel, cache: PagedKVCache, ops: TritonOps | None, *, max_num_batched_tokens: int,
            prefill_chunk_size: int, max_num_seqs: int, max_model_len: int) -> WarmupShapes:
    """Run the largest prefill and decode steps these limits allow once, on blocks taken from ``cache``'s
    pool and given back; the pool must have no block in use (no request in the engine)."""
    began = time.perf_counter()
    alloc, bs = cache.allocator, cache.block_size
    if alloc.num_used:
        raise RuntimeError("warm_up runs before the engine serves: it holds requests or blocks")
    chunks, context, decode_context = warmup_shapes(max_num_batched_tokens, prefill_chunk_size, max_num_seqs,
                                                    max_model_len, alloc.num_free * bs)
    vocab = model.cfg.vocab_size
    paged = ops is not None
    table = alloc.allocate(cache.blocks_for(min(max_model_len, alloc.num_free * bs)))
    try:
        prefills = [PrefillItem([(i * 7 + j) % vocab for j in range(n)], context if i == 0 else 0, table, True)
                    for i, n in enumerate(chunks)]
        model(build_step_batch([], prefills, cache, paged_kernels=paged), cache, None, ops)
        decodes = [DecodeItem(i % vocab, decode_context - 1, table) for i in range(max_num_seqs)]
        logits = model(build_step_batch(decodes, [], cache, paged_kernels=paged), cache, None, ops)
        params = SamplingParams(temperature=1.0, top_p=0.9)
        sample(logits, [params] * len(decodes), [torch.Generator().manual_seed(i) for i in range(len(decodes))])
    finally:
        alloc.free(table)
    if cache.device.type == "cuda":
        torch.cuda.synchronize(cache.device)
    return WarmupShapes(chunks, context, max_num_seqs, decode_context, time.perf_counter() - began)
