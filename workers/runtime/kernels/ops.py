"""The decoder's per-layer operations on the kernel path: what ``DecoderModel`` calls instead of
the torch path when the engine runs its Triton kernels (on CUDA, or under the interpreter in tests).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from workers.runtime.attention import StepBatch
from workers.runtime.kernels import fused
from workers.runtime.kernels.cache_views import CacheTensors, cache_tensors
from workers.runtime.kernels.kv_write import rope_write_kv, write_kv
from workers.runtime.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from workers.runtime.kernels.split_decode import num_splits, split_decode_attention
from workers.runtime.kv_cache import KVLayerStorage


class TritonOps:
    """Stateless but for a memo of each storage's raw tensors (they never move once allocated)."""

    rmsnorm = staticmethod(fused.rmsnorm)
    add_rmsnorm = staticmethod(fused.add_rmsnorm)
    rope_ = staticmethod(fused.rope_)
    silu_mul = staticmethod(fused.silu_mul)

    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._views: dict[int, tuple[KVLayerStorage, CacheTensors]] = {}

    def views(self, storage: KVLayerStorage) -> CacheTensors:
        hit = self._views.get(id(storage))
        if hit is None or hit[0] is not storage:
            hit = (storage, cache_tensors(storage))
            self._views[id(storage)] = hit
        return hit[1]

    def write_kv(self, storage: KVLayerStorage, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        write_kv(self.views(storage), slots, k, v)

    def rope_write_kv(self, storage: KVLayerStorage, slots: torch.Tensor, qk: torch.Tensor, v: torch.Tensor,
                      cos: torch.Tensor, sin: torch.Tensor, num_heads: int) -> None:
        rope_write_kv(self.views(storage), slots, qk, v, cos, sin, num_heads)

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, batch: StepBatch,
                  storage: KVLayerStorage, scale: float) -> torch.Tensor:
        """Same contract as ``attention.paged_attention``; ``batch`` must carry ``kernel``."""
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        meta = batch.kernel
        cache = self.views(storage)
        nd = batch.num_decode
        if nd:
            assert meta is not None
            splits = num_splits(nd, cache.k.shape[1], meta.max_context, self.block_size)
            if splits > 1:
                split_decode_attention(q[:nd], cache, meta.block_tables, meta.decode_lens, scale, self.block_size,
                                       out[:nd], splits)
            else:
                paged_decode_attention(q[:nd], cache, meta.block_tables, meta.decode_lens, scale, self.block_size,
                                       out[:nd])
        for p in batch.prefills:
            if p.context_len == 0:  # a fresh prompt: its own k/v are its whole context
                qs = q[p.token_start:p.token_end].transpose(0, 1).unsqueeze(0)
                ks = k[p.token_start:p.token_end].transpose(0, 1).unsqueeze(0)
                vs = v[p.token_start:p.token_end].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=True)
                out[p.token_start:p.token_end] = o[0].transpose(0, 1)
        if meta is not None and meta.tiles is not None:
            paged_prefill_attention(q, cache, meta.block_tables, meta.tiles, scale, self.block_size, out)
        return out
