"""Lands received KV blocks in the decode engine's paged cache (the ``KVSink`` of kvtransfer).

Per layer, by what the cache stores there:
  - a float layer (fp32/bf16): lossless codecs of the same dtype are copied byte for byte;
    anything else is decoded into the blocks (dequantised);
  - an int8/fp8 layer receiving that same codec: payload and scales are stored as they are
    (``native``: the capacity gain of a quantised cache, no dequantise/requantise);
  - any other pairing: decoded to float and re-quantised per token as the cache writes it.
"""

from __future__ import annotations

from typing import Literal, Sequence

import numpy as np
import torch

from kvtransfer.codecs import Kind, get_codec
from kvtransfer.codecs.encoded import CodecError
from kvtransfer.receiver import WireParts
from workers.runtime.kv_cache import DenseLayerStorage, PagedKVCache, QuantizedLayerStorage

_RAW = {("fp32", torch.float32), ("bf16", torch.bfloat16)}
_NATIVE = {("int8", "int8"), ("fp8", "fp8")}
KVStore = Literal["dequantize", "native"]


def decode_cache_dtypes(codecs: tuple[str, ...], compute_dtype: str, store: KVStore) -> tuple[str, ...]:
    """The decode cache's dtype per layer: ``native`` keeps int8/fp8 layers quantised as received
    (more tokens per byte of pool), ``dequantize`` stores every layer in the compute dtype. int4
    layers are always dequantised (the cache has no int4 storage)."""
    if store == "dequantize":
        return (compute_dtype,) * len(codecs)
    return tuple(c if c in ("int8", "fp8") else compute_dtype for c in codecs)


class CacheSink:
    def __init__(self, cache: PagedKVCache) -> None:
        self.cache = cache
        self.bs = cache.block_size

    def write(self, layer: int, blocks: Sequence[int], codec: str, shape: tuple[int, int, int, int],
              key: WireParts, value: WireParts) -> None:
        storage = self.cache.layers[layer]
        if isinstance(storage, DenseLayerStorage) and (codec, storage.k.dtype) in _RAW:
            for dest, part in ((storage.k, key), (storage.v, value)):
                self._copy_raw(dest, blocks, part.payload, shape)
            return
        if isinstance(storage, QuantizedLayerStorage) and (codec, storage.dtype_name) in _NATIVE:
            self._store_native(storage, blocks, codec, shape, key, value)
            return
        c = get_codec(codec)
        if isinstance(storage, DenseLayerStorage) and _consecutive(blocks):
            # dequantise straight into the blocks from the received bytes: no temporary, no scatter
            first, n = blocks[0], len(blocks)
            for kind, part, dest in ((Kind.KEY, key, storage.k), (Kind.VALUE, value, storage.v)):
                c.decode_buffer_into(kind, shape, part.payload, part.scales, part.zeros,
                                     dest.view(-1, self.bs, *dest.shape[1:])[first:first + n])
            return
        k_enc = c.from_buffer(Kind.KEY, shape, key.payload, key.scales, key.zeros)
        v_enc = c.from_buffer(Kind.VALUE, shape, value.payload, value.scales, value.zeros)
        dtype = storage.k.dtype if isinstance(storage, DenseLayerStorage) else torch.float32
        k, v = c.decode(k_enc, dtype), c.decode(v_enc, dtype)
        storage.write(self._slots(blocks), k.reshape(-1, *shape[2:]), v.reshape(-1, *shape[2:]))

    def _slots(self, blocks: Sequence[int]) -> torch.Tensor:
        b = torch.tensor(blocks, dtype=torch.long)
        return (b[:, None] * self.bs + torch.arange(self.bs)).reshape(-1)

    def _copy_raw(self, dest: torch.Tensor, blocks: Sequence[int], payload: memoryview,
                  shape: tuple[int, int, int, int]) -> None:
        """Byte copy into the blocks, one memcpy per run of consecutive block ids (no temporaries)."""
        per_block = dest[0].nbytes * self.bs
        if payload.nbytes != per_block * len(blocks):
            raise ValueError(f"payload of {payload.nbytes} bytes for {len(blocks)} blocks of {per_block}")
        src = np.frombuffer(payload, dtype=np.uint8).reshape(len(blocks), per_block)
        dst = dest.view(-1, self.bs * dest.shape[1] * dest.shape[2]).view(torch.uint8).numpy()
        for start, end, first in _runs(blocks):
            np.copyto(dst[first:first + end - start], src[start:end])

    def _store_native(self, storage: QuantizedLayerStorage, blocks: Sequence[int], codec: str,
                      shape: tuple[int, int, int, int], key: WireParts, value: WireParts) -> None:
        """Payload bytes copied as they are, one memcpy per run of consecutive block ids; the scales
        (int8: per (block, head), fp8: per block) broadcast to the cache's one per (token, head)."""
        n, bs, h, d = shape
        per_block = bs * h * d
        groups = h if codec == "int8" else 1
        runs = _runs(blocks)
        for data, scale, part in ((storage.k, storage.k_scale, key), (storage.v, storage.v_scale, value)):
            if part.payload.nbytes != n * per_block:
                raise CodecError(f"payload has {part.payload.nbytes} bytes, expected {n * per_block} for {n} "
                                 f"{codec} blocks")
            if part.scales.nbytes != n * groups * 4:
                raise CodecError(f"scales have {part.scales.nbytes} bytes, expected {n * groups * 4} for {n} "
                                 f"{codec} blocks")
            src = np.frombuffer(part.payload, dtype=np.uint8).reshape(n, per_block)
            dst = data.view(torch.uint8).view(-1, per_block).numpy()
            s = torch.from_numpy(np.frombuffer(part.scales, dtype=np.float32).reshape(n, 1, groups).copy())
            s_dst = scale.view(-1, bs, h)
            for start, end, first in runs:
                np.copyto(dst[first:first + end - start], src[start:end])
                s_dst[first:first + end - start].copy_(s[start:end].expand(-1, bs, h))


def _consecutive(blocks: Sequence[int]) -> bool:
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


def _runs(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, first block id) of each maximal run of consecutive ids in ``blocks``."""
    runs = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            runs.append((start, i, blocks[start]))
            start = i
    return runs
