"""The raw tensors of one layer's KV storage, as the kernels take them."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.runtime.kv_cache import DenseLayerStorage, KVLayerStorage, QuantizedLayerStorage

# Storage kinds, a constexpr in every kernel that reads or writes the cache.
DENSE, INT8, FP8 = 0, 1, 2


@dataclass(frozen=True)
class CacheTensors:
    """k, v: [slots, kv_heads, head_dim] (fp8 viewed as uint8); scales: [slots, kv_heads] float32 or None."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor | None
    v_scale: torch.Tensor | None
    kind: int
    qmax: float


def cache_tensors(storage: KVLayerStorage) -> CacheTensors:
    if isinstance(storage, DenseLayerStorage):
        return CacheTensors(storage.k, storage.v, None, None, DENSE, 0.0)
    if isinstance(storage, QuantizedLayerStorage):
        if storage.k.dtype == torch.int8:
            return CacheTensors(storage.k, storage.v, storage.k_scale, storage.v_scale, INT8, 127.0)
        return CacheTensors(storage.k.view(torch.uint8), storage.v.view(torch.uint8), storage.k_scale,
                            storage.v_scale, FP8, 448.0)
    raise TypeError(f"no kernel reads a {type(storage).__name__}")


def scale_args(c: CacheTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """The scale pointers a kernel takes: the real scales, or k/v themselves (never read) when dense."""
    if c.k_scale is None or c.v_scale is None:
        return c.k, c.v
    return c.k_scale, c.v_scale
