"""A paged cache layer stored quantised, as the block-indexed encode reads it (kvtransfer.codecs.fused).

A quantised prefill cache keeps K or V as int8 or fp8 e4m3 codes with one float32 scale per (token, head).
What such a layer sends is what the engine's gather hands over: ``code * scale`` in float32, rounded to the
engine's dtype. ``QuantizedBlocks.gather`` is that, in torch, and the reference the fused kernels match.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtransfer.codecs.base import CACHE_DTYPES
from kvtransfer.codecs.encoded import CodecError

__all__ = ["QUANTIZED_CACHE_DTYPES", "QuantizedBlocks"]

QUANTIZED_CACHE_DTYPES = (torch.int8, torch.float8_e4m3fn)


@dataclass(frozen=True)
class QuantizedBlocks:
    """One layer's keys or values in a quantised paged cache.

    data: [num_blocks, block_size, kv_heads, head_dim] int8 or float8_e4m3fn codes; scales: [num_blocks,
    block_size, kv_heads] float32, one per (token, head), on data's device; dtype: float32 or bfloat16,
    what a value ``code * scale`` (float32) is rounded to. Any strides. Raises CodecError otherwise."""

    data: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.data.dtype not in QUANTIZED_CACHE_DTYPES or self.data.dim() != 4:
            raise CodecError(f"quantised cache data must be int8/float8_e4m3fn [num_blocks, block_size, kv_heads, "
                             f"head_dim], got {self.data.dtype} {tuple(self.data.shape)}")
        if self.scales.dtype != torch.float32 or tuple(self.scales.shape) != tuple(self.data.shape[:3]):
            raise CodecError(f"quantised cache scales must be float32 {tuple(self.data.shape[:3])}, got "
                             f"{self.scales.dtype} {tuple(self.scales.shape)}")
        if self.scales.device != self.data.device:
            raise CodecError(f"quantised cache scales on {self.scales.device}, data on {self.data.device}")
        if self.dtype not in CACHE_DTYPES:
            raise CodecError(f"a quantised cache is read as float32 or bfloat16, not {self.dtype}")

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    def block_nbytes(self) -> int:
        """Bytes one block holds: its codes and its scales."""
        return self.data[0].nbytes + self.scales[0].nbytes

    def gather(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks ``ids`` (1-D long, on the cache's device) dequantised: a new contiguous [n, block_size,
        kv_heads, head_dim] tensor of ``dtype``, as the engine's gather computes it."""
        codes = self.data.view(torch.uint8).index_select(0, ids).view(self.data.dtype)  # uint8: CPU has no fp8 index
        x = codes.to(torch.float32) * self.scales.index_select(0, ids)[..., None]
        return x.to(self.dtype)
