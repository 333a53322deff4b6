"""Paged KV cache: a block allocator plus per-layer storage, dense or quantised.

Layout. The pool holds ``num_blocks`` blocks of ``block_size`` tokens. Token ``t`` of a sequence
lives in slot ``block_table[t // block_size] * block_size + t % block_size``. Each layer owns its
own storage object, so layers may differ in dtype: a decode worker can keep some layers in bf16
and others quantised (int8/fp8 with a scale per token and head), which is what raises capacity.

Sizing. ``PagedKVCache.from_budget`` turns a byte budget into a block count; the pool is
allocated once and never grows.

Ownership. Blocks are refcounted: ``allocate`` hands out blocks at refcount 1, ``share`` adds a
holder (prefix sharing), ``free`` drops one; a block returns to the free list at zero.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, Protocol

import torch

from workers.runtime.devices import resolve_device
from workers.runtime.errors import CapacityError, InvalidRequestError

CacheDType = Literal["float32", "bfloat16", "float16", "int8", "fp8"]
_DENSE = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_QUANT = {"int8": (torch.int8, 127.0), "fp8": (torch.float8_e4m3fn, 448.0)}
CACHE_DTYPES: tuple[str, ...] = tuple(_DENSE) + tuple(_QUANT)


@dataclass(frozen=True)
class KVCacheSpec:
    """The shape of one layer's cache; with the layer dtypes it fixes the bytes per block."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int = 16

    def __post_init__(self) -> None:
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise InvalidRequestError(f"block_size must be a positive power of two, got {self.block_size}")

    def layer_bytes_per_block(self, dtype: CacheDType) -> int:
        if dtype not in _DENSE and dtype not in _QUANT:
            raise InvalidRequestError(f"unknown KV cache dtype {dtype!r}; supported: {', '.join(CACHE_DTYPES)}")
        elems = 2 * self.block_size * self.num_kv_heads * self.head_dim  # keys and values
        if dtype in _DENSE:
            return elems * torch.empty((), dtype=_DENSE[dtype]).element_size()
        scale_bytes = 2 * self.block_size * self.num_kv_heads * 4  # float32 scale per (token, head)
        return elems + scale_bytes

    def bytes_per_block(self, layer_dtypes: tuple[CacheDType, ...]) -> int:
        return sum(self.layer_bytes_per_block(d) for d in layer_dtypes)


class KVLayerStorage(Protocol):
    """One layer's K and V for the whole pool. Slots index tokens across all blocks."""

    dtype_name: CacheDType

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k, v ([tokens, kv_heads, head_dim], compute dtype) at ``slots`` ([tokens])."""

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Return k, v at ``slots`` ([n]) as [n, kv_heads, head_dim] in ``dtype``."""

    def pool_tensors(self) -> tuple[torch.Tensor, ...]:
        """Every tensor the layer's pool memory is (codes, values, scales): what its bytes count."""


class DenseLayerStorage:
    """K/V stored as-is in a float dtype (lossless when it equals the compute dtype)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, dtype_name: CacheDType, device: torch.device) -> None:
        self.dtype_name = dtype_name
        shape = (num_blocks * spec.block_size, spec.num_kv_heads, spec.head_dim)
        self.k = torch.zeros(shape, dtype=_DENSE[dtype_name], device=device)
        self.v = torch.zeros(shape, dtype=_DENSE[dtype_name], device=device)

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        self.k.index_copy_(0, slots, k.to(self.k.dtype))
        self.v.index_copy_(0, slots, v.to(self.v.dtype))

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k.index_select(0, slots).to(dtype), self.v.index_select(0, slots).to(dtype)

    def pool_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v


class QuantizedLayerStorage:
    """K/V stored as int8 or fp8 e4m3 with a float32 scale per (token, head).

    A per-token scale means a token is quantised once, when written, and never re-quantised as
    its block fills up; received blocks with per-block or per-(block, head) scales store by
    broadcasting their scale to the block's tokens.
    """

    def __init__(self, spec: KVCacheSpec, num_blocks: int, dtype_name: CacheDType, device: torch.device) -> None:
        self.dtype_name = dtype_name
        self._qdtype, self._qmax = _QUANT[dtype_name]
        # A tensor on the cache's device, not a Python number: CUDA turns division by a host scalar
        # into a multiply by its reciprocal, which can move a scale by one bit against the CPU and
        # the Triton KV write; a device tensor divides exactly everywhere.
        self._qmax_t = torch.tensor(float(self._qmax), dtype=torch.float32, device=device)
        slots = num_blocks * spec.block_size
        self.k = torch.zeros((slots, spec.num_kv_heads, spec.head_dim), dtype=self._qdtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.k_scale = torch.zeros((slots, spec.num_kv_heads), dtype=torch.float32, device=device)
        self.v_scale = torch.zeros_like(self.k_scale)

    def _quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x.to(torch.float32)
        scale = x.abs().amax(dim=-1).clamp_min_(1e-12) / self._qmax_t
        q = x / scale[..., None]
        if self._qdtype == torch.int8:
            q = q.round_().clamp_(-self._qmax, self._qmax)
        return q.to(self._qdtype), scale

    def write(self, slots: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        for data, scale, x in ((self.k, self.k_scale, k), (self.v, self.v_scale, v)):
            q, s = self._quantize(x)
            # Copy the raw bytes: CPU index_copy_ has no float8 kernel (int8 is 1 byte too, so same path).
            data.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
            scale.index_copy_(0, slots, s)

    def gather(self, slots: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        out = []
        for data, scale in ((self.k, self.k_scale), (self.v, self.v_scale)):
            x = data.index_select(0, slots).to(torch.float32) * scale.index_select(0, slots)[..., None]
            out.append(x.to(dtype))
        return out[0], out[1]

    def pool_tensors(self) -> tuple[torch.Tensor, ...]:
        return self.k, self.v, self.k_scale, self.v_scale


def make_layer_storage(spec: KVCacheSpec, num_blocks: int, dtype_name: CacheDType,
                       device: torch.device) -> KVLayerStorage:
    if dtype_name in _DENSE:
        return DenseLayerStorage(spec, num_blocks, dtype_name, device)
    if dtype_name in _QUANT:
        return QuantizedLayerStorage(spec, num_blocks, dtype_name, device)
    raise InvalidRequestError(f"unknown KV cache dtype {dtype_name!r}; supported: {', '.join(CACHE_DTYPES)}")


def block_slots(blocks: list[int], block_size: int, device: torch.device) -> torch.Tensor:
    """Slot ids of every token of ``blocks`` (in order), a long tensor on ``device``: the cache's, as
    index ops refuse an index on another device."""
    b = torch.tensor(blocks, dtype=torch.long, device=device)
    return (b[:, None] * block_size + torch.arange(block_size, device=device)).reshape(-1)


class BlockAllocator:
    """A free list of block ids with refcounts, and the prefix cache's index. Pure bookkeeping: it never
    touches tensors. ``on_free`` is called before blocks that lost their last holder become free.

    Prefix cache. A full, computed block may be ``register``-ed under its chained content digest
    (``workers.runtime.prefix_cache``). When its last holder frees it, it stays indexed but joins the free
    blocks as *evictable*: ``match`` finds it and ``take`` gives it a holder again. ``allocate`` hands out
    never-indexed free blocks first, then evicts the least recently freed evictable ones (dropping them from
    the index). A sequence's blocks are freed tail first, so its later blocks are evicted before the prefix
    others share. ``num_free`` counts evictable blocks: they are free to anyone who needs the room."""

    def __init__(self, num_blocks: int, on_free: Callable[[], None] | None = None) -> None:
        if num_blocks <= 0:
            raise CapacityError(f"the KV pool must hold at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.on_free = on_free
        # Pop from the end: low block ids are handed out first, which keeps tests readable.
        self._free: list[int] = list(range(num_blocks - 1, -1, -1))
        self._refcount = [0] * num_blocks
        self._digest_of: dict[int, bytes] = {}  # indexed block -> its digest
        self._block_of: dict[bytes, int] = {}  # digest -> the indexed block holding it
        self._evictable: OrderedDict[int, None] = OrderedDict()  # indexed, no holder; least recently freed first

    @property
    def num_free(self) -> int:
        return len(self._free) + len(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Blocks in the prefix cache's index, held or evictable."""
        return len(self._block_of)

    def can_allocate(self, n: int) -> bool:
        return n <= self.num_free

    def allocate(self, n: int) -> list[int]:
        """Take ``n`` free blocks at refcount 1; all or nothing. Evicts cached blocks only when the
        never-indexed ones run out."""
        if n < 0:
            raise ValueError(f"cannot allocate {n} blocks")
        if n > self.num_free:
            raise CapacityError(f"need {n} KV blocks, {self.num_free} free of {self.num_blocks}")
        fresh = min(n, len(self._free))
        blocks = [self._free.pop() for _ in range(fresh)]
        for _ in range(n - fresh):
            b, _ = self._evictable.popitem(last=False)
            del self._block_of[self._digest_of.pop(b)]
            blocks.append(b)
        for b in blocks:
            self._refcount[b] = 1
        return blocks

    def share(self, blocks: list[int]) -> None:
        """Add one holder to each (already allocated) block."""
        for b in blocks:
            if not 0 <= b < self.num_blocks or self._refcount[b] <= 0:  # a negative id would wrap around
                raise ValueError(f"block {b} is not allocated")
        for b in blocks:
            self._refcount[b] += 1

    def free(self, blocks: list[int]) -> None:
        """Drop one holder from each block; a block with no holder becomes free (evictable if indexed)."""
        # Count repeats: freeing [b, b] drops two holders, so b must have at least two.
        for b, n in Counter(blocks).items():
            if not 0 <= b < self.num_blocks:
                raise ValueError(f"block {b} is not in the pool of {self.num_blocks}")
            if self._refcount[b] < n:
                raise ValueError(f"double free of block {b}")
        released = []
        for b in blocks:
            self._refcount[b] -= 1
            if self._refcount[b] == 0:
                released.append(b)
        try:
            if released and self.on_free is not None:
                self.on_free()
        finally:  # the blocks are free whatever the hook raised (a CUDA error): never lost to the pool
            self._free.extend(b for b in released if b not in self._digest_of)
            for b in reversed(released):  # tail first: a sequence's later blocks are evicted before its prefix
                if b in self._digest_of:
                    self._evictable[b] = None

    def refcount(self, block: int) -> int:
        return self._refcount[block]

    # ------------------------------------------------------------------ prefix cache
    def register(self, block: int, digest: bytes) -> bool:
        """Index a held, full, computed ``block`` under ``digest``. False (and nothing changes) when the
        digest is indexed already (another block computed the same prefix) or the block is indexed."""
        if not 0 <= block < self.num_blocks or self._refcount[block] <= 0:
            raise ValueError(f"block {block} is not allocated")
        if digest in self._block_of or block in self._digest_of:
            return False
        self._block_of[digest] = block
        self._digest_of[block] = digest
        return True

    def match(self, digests: list[bytes]) -> list[int]:
        """The indexed blocks of the longest prefix of ``digests``; takes nothing."""
        blocks = []
        for d in digests:
            b = self._block_of.get(d)
            if b is None:
                break
            blocks.append(b)
        return blocks

    def take(self, blocks: list[int]) -> None:
        """Add one holder to each indexed block (``match``'s result): an evictable one stops being free."""
        for b in blocks:
            if b not in self._digest_of:
                raise ValueError(f"block {b} is not in the prefix cache")
        for b in blocks:
            if self._refcount[b] == 0:
                del self._evictable[b]
            self._refcount[b] += 1

    def reset_prefix_cache(self) -> int:
        """Forget every indexed block; evictable ones become plain free blocks. Returns how many were indexed."""
        n = len(self._block_of)
        # emptied before the blocks join the free list, so a lock-free num_free never counts them twice
        evictable, self._evictable = list(self._evictable), OrderedDict()
        self._block_of.clear()
        self._digest_of.clear()
        self._free.extend(evictable)
        return n


class PagedKVCache:
    """The preallocated pool: allocator plus one storage per layer.

    ``free_fence`` (CUDA): an event recorded on the device's default stream, where the engine runs, each
    time blocks return to the free list. Work the engine queued before a free may still write those blocks
    (a step that sampled nothing is not waited for), so a side stream that lands received KV in blocks it
    reserved since waits for the fence first (a device-side wait, done at once in the usual case)."""

    def __init__(self, spec: KVCacheSpec, num_blocks: int, layer_dtypes: tuple[CacheDType, ...],
                 device: torch.device | str = "cpu", *, read_dtype: torch.dtype = torch.float32) -> None:
        """``read_dtype``: the dtype attention reads every layer in (the model's compute dtype), which bounds
        what a layer may hold whatever its storage."""
        if len(layer_dtypes) != spec.num_layers:
            raise InvalidRequestError(
                f"layer_dtypes names {len(layer_dtypes)} layers, the model has {spec.num_layers}")
        self.spec = spec
        self.device = resolve_device(device)
        self.layer_dtypes = layer_dtypes
        self.read_dtype = read_dtype
        self.free_fence: torch.cuda.Event | None = None
        self.allocator = BlockAllocator(num_blocks, self._fence_frees if self.device.type == "cuda" else None)
        self.layers: list[KVLayerStorage] = [
            make_layer_storage(spec, num_blocks, d, self.device) for d in layer_dtypes]

    def _fence_frees(self) -> None:
        fence = torch.cuda.Event()
        fence.record(torch.cuda.default_stream(self.device))
        self.free_fence = fence

    @classmethod
    def from_budget(cls, spec: KVCacheSpec, budget_bytes: int, layer_dtypes: tuple[CacheDType, ...],
                    device: torch.device | str = "cpu", *, read_dtype: torch.dtype = torch.float32) -> PagedKVCache:
        per_block = spec.bytes_per_block(layer_dtypes)
        num_blocks = budget_bytes // per_block
        if num_blocks < 1:
            raise CapacityError(
                f"KV cache budget of {budget_bytes} bytes is smaller than one block ({per_block} bytes)")
        return cls(spec, num_blocks, layer_dtypes, device, read_dtype=read_dtype)

    @property
    def block_size(self) -> int:
        return self.spec.block_size

    @property
    def num_blocks(self) -> int:
        return self.allocator.num_blocks

    @property
    def nbytes(self) -> int:
        """Bytes the pool holds, across all layers (scales included)."""
        return self.num_blocks * self.spec.bytes_per_block(self.layer_dtypes)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.spec.block_size)

    def slots_for(self, block_table: list[int], start: int, end: int) -> torch.Tensor:
        """Slot indices of tokens [start, end) of a sequence with this block table."""
        bs = self.spec.block_size
        pos = torch.arange(start, end, device=self.device)
        table = torch.tensor(block_table, dtype=torch.long, device=self.device)
        return table[pos // bs] * bs + pos % bs

    def read_tokens(self, layer: int, block_table: list[int], num_tokens: int,
                    dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """k, v of a sequence's first ``num_tokens`` tokens at ``layer``: [tokens, kv_heads, head_dim]."""
        return self.layers[layer].gather(self.slots_for(block_table, 0, num_tokens), dtype)
