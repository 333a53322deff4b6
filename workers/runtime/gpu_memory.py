"""Sizing the KV pool from the GPU's free memory, as vLLM's ``gpu_memory_utilization`` does: the share of
the card this process may take, whatever other processes hold.

budget = total * utilization - (this process's memory outside torch's allocator) - (torch's peak during a
profile forward of the largest step, less the profile's own KV blocks, or during sampling a full batch,
whichever is higher). The profile runs once at start-up, after the weights are loaded, over a temporary cache
that is freed before the pool is allocated. Memory outside torch is counted from what the device held when
this process first put a model on it (``devices.note_memory_baseline``): what other processes held then is
theirs; what they allocate later counts here too (never less than this process's own).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from workers.runtime.attention import PrefillItem, build_step_batch
from workers.runtime.devices import memory_baseline
from workers.runtime.errors import CapacityError
from workers.runtime.kv_cache import CacheDType, KVCacheSpec, PagedKVCache
from workers.runtime.model import DecoderModel
from workers.runtime.sampler import SamplingParams, sample

if TYPE_CHECKING:
    from workers.runtime.kernels.ops import TritonOps


def own_outside_torch(used: int, reserved: int, used_then: int, reserved_then: int) -> int:
    """Bytes this process holds on the device outside torch's allocator (CUDA context, libraries): what the
    device gained since the baseline (``used_then``, ``reserved_then``) less what torch reserved since."""
    return max(0, (used - used_then) - (reserved - reserved_then))


def kv_budget(total: int, free: int, utilization: float, outside_torch: int, peak: int, allocated: int,
              per_block: int) -> int:
    """Bytes the KV pool may take: ``total * utilization`` less this process's memory outside torch and torch's
    ``peak``. CapacityError, naming the numbers, when that leaves no block, or when what is ``free`` now
    (other processes' memory taken out) cannot hold it and the largest step's activations (``peak -
    allocated``: freed after the profile, needed again by the first such step), as vLLM refuses a share that
    is not free."""
    gib = 2**30
    budget = int(total * utilization) - outside_torch - peak
    if budget < per_block:
        raise CapacityError(
            f"no GPU memory left for the KV cache: {total * utilization / gib:.2f} GiB allowed "
            f"(gpu_memory_utilization={utilization}), weights and activations peak at {peak / gib:.2f} GiB, "
            f"{outside_torch / gib:.2f} GiB used outside torch by this process")
    needed = budget + max(0, peak - allocated)
    if needed > free:
        raise CapacityError(
            f"gpu_memory_utilization={utilization} gives the KV cache {budget / gib:.2f} GiB, and with the largest "
            f"step's activations that needs {needed / gib:.2f} GiB, but only {free / gib:.2f} GiB of the GPU are "
            f"free (other processes hold the rest): lower gpu_memory_utilization or set kv_cache_bytes")
    return budget


def kv_budget_from_free_memory(model: DecoderModel, spec: KVCacheSpec, layer_dtypes: tuple[CacheDType, ...],
                               utilization: float, profile_tokens: int, ops: TritonOps | None,
                               sample_rows: int = 1) -> int:
    """Bytes the KV pool may take on ``model.device`` (CUDA); CapacityError when not one block fits.
    ``sample_rows``: the most sequences a step samples (``max_num_seqs``)."""
    device = model.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    blocks = -(-profile_tokens // spec.block_size)
    scratch = PagedKVCache(spec, blocks, layer_dtypes, device)
    batch = build_step_batch([], [PrefillItem([0] * profile_tokens, 0, list(range(blocks)), want_logits=True)],
                             scratch, paged_kernels=ops is not None)
    model(batch, scratch, None, ops)
    del batch
    # Sampling runs on the device: a full batch of top_p rows over flat logits is its worst case (full sorts).
    flat = torch.zeros(sample_rows, model.cfg.vocab_size, device=device)
    sample(flat, [SamplingParams(temperature=1.0, top_p=0.9)] * sample_rows,
           [torch.Generator().manual_seed(i) for i in range(sample_rows)])
    del flat
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - scratch.nbytes
    del scratch
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_then, reserved_then = memory_baseline(device)
    outside_torch = own_outside_torch(total - free, torch.cuda.memory_reserved(device), used_then, reserved_then)
    return kv_budget(total, free, utilization, outside_torch, peak, torch.cuda.memory_allocated(device),
                     spec.bytes_per_block(layer_dtypes))
