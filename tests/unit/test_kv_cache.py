"""Paged KV cache: block bookkeeping, sizing from a byte budget, slot mapping, dense and quantised storage.

Quantisation bounds checked here, per element x of a (token, head) row with amax = max |x| over the row:
  int8: |x - x'| <= amax / 127 / 2                      (half a step of the per-row grid)
  fp8 : |x - x'| <= 2^-4 |x| + 2^-10 * amax / 448       (half an e4m3 ulp, subnormals included)
        which implies |x - x'| <= amax / 28 (half the top binade's ulp, 16 of 448) <= 2^-3 amax.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from workers.runtime.errors import CapacityError, InvalidRequestError
from workers.runtime.kv_cache import (
    CACHE_DTYPES,
    BlockAllocator,
    CacheDType,
    DenseLayerStorage,
    KVCacheSpec,
    PagedKVCache,
    QuantizedLayerStorage,
    make_layer_storage,
)

pytestmark = [pytest.mark.unit]

CPU = torch.device("cpu")
SLACK = 1 + 1e-5


def _storage_bytes(cache: PagedKVCache) -> int:
    """Bytes actually allocated by the layer storages (not what the cache claims): every tensor they
    hold, less 0-d constants such as a quantised layer's qmax; their pool_tensors() are exactly these."""
    total = 0
    for layer in cache.layers:
        for t in vars(layer).values():
            if isinstance(t, torch.Tensor) and t.dim() > 0:
                total += t.numel() * t.element_size()
        pool = layer.pool_tensors()
        assert sorted(map(id, pool)) == sorted(id(t) for t in vars(layer).values()
                                               if isinstance(t, torch.Tensor) and t.dim() > 0)
    return total


def _kv(tokens: int, heads: int, dim: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    # rows spanning six orders of magnitude, and heavy-tailed values within a row
    scale = torch.logspace(-3, 3, tokens)[:, None, None]
    k = torch.randn(tokens, heads, dim, generator=gen) * scale
    v = torch.randn(tokens, heads, dim, generator=gen).pow(3)
    return k, v


# ---------------------------------------------------------------- BlockAllocator
def test_allocate_hands_out_low_ids_first_and_counts() -> None:
    a = BlockAllocator(6)
    assert (a.num_free, a.num_used) == (6, 0)
    assert a.allocate(3) == [0, 1, 2]
    assert a.allocate(1) == [3]
    assert (a.num_free, a.num_used) == (2, 4)
    assert all(a.refcount(b) == 1 for b in range(4)) and a.refcount(4) == 0
    assert a.allocate(0) == []


def test_allocation_is_all_or_nothing() -> None:
    a = BlockAllocator(4)
    a.allocate(3)
    assert a.can_allocate(1) and not a.can_allocate(2)
    with pytest.raises(CapacityError, match="need 2 KV blocks, 1 free of 4"):
        a.allocate(2)
    assert a.num_free == 1 and a.allocate(1) == [3]


def test_free_in_any_order_returns_blocks() -> None:
    a = BlockAllocator(5)
    blocks = a.allocate(5)
    a.free([blocks[3], blocks[0]])
    a.free([blocks[4], blocks[1], blocks[2]])
    assert a.num_free == 5 and all(a.refcount(b) == 0 for b in blocks)
    assert sorted(a.allocate(5)) == list(range(5))


def test_freed_blocks_are_reused() -> None:
    a = BlockAllocator(8)
    first = a.allocate(4)
    a.allocate(2)
    a.free(first[1:3])
    assert sorted(a.allocate(2)) == first[1:3]
    assert a.allocate(2) == [6, 7]
    assert a.num_free == 0


def test_share_keeps_a_block_until_every_holder_frees() -> None:
    a = BlockAllocator(3)
    blocks = a.allocate(2)
    a.share(blocks)
    a.share(blocks[:1])
    assert [a.refcount(b) for b in blocks] == [3, 2]
    a.free(blocks)
    assert [a.refcount(b) for b in blocks] == [2, 1] and a.num_free == 1
    a.free(blocks)
    assert [a.refcount(b) for b in blocks] == [1, 0] and a.num_free == 2
    a.free(blocks[:1])
    assert a.num_free == 3


def test_on_free_runs_before_released_blocks_can_be_allocated_again() -> None:
    seen: list[int] = []  # free blocks at each call: the released ones are not back yet
    a = BlockAllocator(3, on_free=lambda: seen.append(a.num_free))
    blocks = a.allocate(2)
    a.share(blocks[:1])
    a.free(blocks)  # blocks[1] released, blocks[0] still held
    assert seen == [1] and a.num_free == 2
    with pytest.raises(ValueError, match="double free"):
        a.free(blocks[1:])
    a.free([])
    assert seen == [1]  # a refused or empty free releases nothing and calls nothing
    a.free(blocks[:1])
    assert seen == [1, 2] and a.num_free == 3


def test_double_free_raises_and_changes_nothing() -> None:
    a = BlockAllocator(4)
    b0, b1 = a.allocate(2)
    a.free([b0])
    with pytest.raises(ValueError, match=f"double free of block {b0}"):
        a.free([b0])
    with pytest.raises(ValueError, match=f"double free of block {b0}"):
        a.free([b1, b0])  # validated before any change: b1 keeps its holder
    assert a.refcount(b1) == 1 and a.num_free == 3


def test_repeated_block_in_one_free_call_counts_twice() -> None:
    a = BlockAllocator(4)
    (b,) = a.allocate(1)
    with pytest.raises(ValueError, match=f"double free of block {b}"):
        a.free([b, b])
    assert a.refcount(b) == 1 and a.num_free == 3
    a.share([b])
    a.free([b, b])  # two holders, two frees: fine
    assert a.refcount(b) == 0 and a.num_free == 4
    assert sorted(a.allocate(4)) == [0, 1, 2, 3]  # and the pool holds each block exactly once


@pytest.mark.parametrize("bad", [-1, 4, 100])
def test_out_of_range_blocks_are_refused(bad: int) -> None:
    a = BlockAllocator(4)
    a.allocate(4)
    with pytest.raises(ValueError, match=f"block {bad} is not"):
        a.free([bad])
    with pytest.raises(ValueError, match=f"block {bad} is not allocated"):
        a.share([bad])
    assert a.num_free == 0 and all(a.refcount(b) == 1 for b in range(4))


def test_share_of_free_block_raises() -> None:
    a = BlockAllocator(2)
    a.allocate(1)
    with pytest.raises(ValueError, match="block 1 is not allocated"):
        a.share([0, 1])
    assert a.refcount(0) == 1


def test_empty_pool_is_refused() -> None:
    with pytest.raises(CapacityError, match="at least one block"):
        BlockAllocator(0)


def test_random_workload_keeps_the_books_straight() -> None:
    rng = random.Random(0)
    a = BlockAllocator(32)
    holders: list[list[int]] = []  # each entry: one holder's blocks
    for _ in range(2000):
        op = rng.random()
        if op < 0.45:
            n = rng.randint(1, 6)
            if a.can_allocate(n):
                holders.append(a.allocate(n))
            else:
                with pytest.raises(CapacityError):
                    a.allocate(n)
        elif op < 0.6 and holders:
            shared = rng.choice(holders)[: rng.randint(1, 3)]
            a.share(shared)
            holders.append(list(shared))
        elif holders:
            a.free(holders.pop(rng.randrange(len(holders))))
        expected = [0] * 32
        for blocks in holders:
            for b in blocks:
                expected[b] += 1
        assert [a.refcount(b) for b in range(32)] == expected
        assert a.num_free == expected.count(0)
    for blocks in holders:
        a.free(blocks)
    assert a.num_free == 32  # no leak


# ---------------------------------------------------------------- spec and sizing
@pytest.mark.parametrize("block_size", [0, -4, 3, 12, 24])
def test_block_size_must_be_power_of_two(block_size: int) -> None:
    with pytest.raises(InvalidRequestError, match="block_size must be a positive power of two"):
        KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=8, block_size=block_size)


def test_bytes_per_block() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=64, block_size=16)
    elems = 2 * 16 * 4 * 64
    assert spec.layer_bytes_per_block("float32") == 4 * elems
    assert spec.layer_bytes_per_block("bfloat16") == spec.layer_bytes_per_block("float16") == 2 * elems
    assert spec.layer_bytes_per_block("int8") == spec.layer_bytes_per_block("fp8") == elems + 2 * 16 * 4 * 4
    assert spec.bytes_per_block(("bfloat16", "int8")) == 2 * elems + elems + 512


@pytest.mark.parametrize("layer_dtypes", [
    ("float32", "float32"),
    ("bfloat16", "bfloat16"),
    ("float16", "int8"),
    ("fp8", "fp8"),
    ("bfloat16", "fp8"),
])
@pytest.mark.parametrize("heads,dim,block_size", [(2, 16, 4), (4, 64, 16), (1, 8, 1)])
def test_from_budget_never_exceeds_budget(layer_dtypes: tuple, heads: int, dim: int, block_size: int) -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=heads, head_dim=dim, block_size=block_size)
    per_block = spec.bytes_per_block(layer_dtypes)
    for budget in (per_block, per_block + 1, 3 * per_block - 1, 7 * per_block, 12_345 + 5 * per_block):
        cache = PagedKVCache.from_budget(spec, budget, layer_dtypes)
        assert cache.nbytes <= budget
        assert cache.nbytes + per_block > budget  # and uses as much of it as whole blocks allow
        assert _storage_bytes(cache) == cache.nbytes  # what it claims is what it allocated
        assert cache.num_blocks == budget // per_block
        assert [layer.dtype_name for layer in cache.layers] == list(layer_dtypes)


@pytest.mark.parametrize("budget_blocks", [0, 0.5, 0.999])
def test_budget_below_one_block(budget_blocks: float) -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=16, block_size=8)
    per_block = spec.bytes_per_block(("bfloat16",) * 3)
    with pytest.raises(CapacityError, match=f"smaller than one block \\({per_block} bytes\\)"):
        PagedKVCache.from_budget(spec, int(per_block * budget_blocks), ("bfloat16",) * 3)


def test_unknown_dtype_lists_supported() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(InvalidRequestError) as info:
        PagedKVCache(spec, 4, ("bfloat16", "int4"))  # type: ignore[arg-type]  # refused: the test
    msg = str(info.value)
    assert "'int4'" in msg and all(d in msg for d in CACHE_DTYPES)
    with pytest.raises(InvalidRequestError, match="unknown KV cache dtype 'float64'"):
        make_layer_storage(spec, 4, "float64", CPU)  # type: ignore[arg-type]  # refused: the test


def test_layer_dtypes_must_cover_every_layer() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    with pytest.raises(InvalidRequestError, match="names 2 layers, the model has 3"):
        PagedKVCache(spec, 4, ("bfloat16", "bfloat16"))


def test_storage_kinds_per_layer() -> None:
    spec = KVCacheSpec(num_layers=3, num_kv_heads=2, head_dim=8, block_size=4)
    cache = PagedKVCache(spec, 4, ("bfloat16", "int8", "fp8"))
    assert isinstance(cache.layers[0], DenseLayerStorage) and cache.layers[0].k.dtype == torch.bfloat16
    assert isinstance(cache.layers[1], QuantizedLayerStorage) and cache.layers[1].k.dtype == torch.int8
    assert isinstance(cache.layers[2], QuantizedLayerStorage) and cache.layers[2].k.dtype == torch.float8_e4m3fn


# ---------------------------------------------------------------- slots
def test_slots_for_follows_the_block_table() -> None:
    cache = PagedKVCache(KVCacheSpec(num_layers=1, num_kv_heads=1, head_dim=2, block_size=4), 6, ("float32",))
    assert cache.slots_for([3, 0, 5], 2, 10).tolist() == [14, 15, 0, 1, 2, 3, 20, 21]
    assert cache.slots_for([3, 0, 5], 0, 12).tolist() == [12, 13, 14, 15, 0, 1, 2, 3, 20, 21, 22, 23]
    assert cache.slots_for([2], 1, 1).tolist() == []
    assert [cache.blocks_for(n) for n in (0, 1, 4, 5, 8, 9)] == [0, 1, 1, 2, 2, 3]


# ---------------------------------------------------------------- storage round trips
@pytest.mark.parametrize("dtype_name,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                              ("float16", torch.float16)])
def test_dense_write_gather_exact(dtype_name: CacheDType, dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=3, head_dim=8, block_size=4)
    store = DenseLayerStorage(spec, 4, dtype_name, CPU)
    k, v = _kv(10, 3, 8, seed=1)
    k, v = k.clamp(-1e3, 1e3), v.clamp(-1e3, 1e3)  # inside float16 range
    slots = torch.tensor([15, 0, 7, 3, 8, 12, 1, 2, 9, 4])
    store.write(slots, k.to(dtype), v.to(dtype))
    gk, gv = store.gather(slots, dtype)
    assert torch.equal(gk, k.to(dtype)) and torch.equal(gv, v.to(dtype))
    untouched = torch.tensor(sorted(set(range(16)) - set(slots.tolist())))
    assert not store.k[untouched].any() and not store.v[untouched].any()
    # gathering in another dtype casts; overwriting a slot replaces it
    assert torch.equal(store.gather(slots[:2], torch.float32)[0], k[:2].to(dtype).float())
    store.write(slots[:1], v[:1].to(dtype), k[:1].to(dtype))
    assert torch.equal(store.gather(slots[:1], dtype)[0], v[:1].to(dtype))


def test_cache_read_tokens_in_sequence_order() -> None:
    spec = KVCacheSpec(num_layers=2, num_kv_heads=2, head_dim=4, block_size=4)
    cache = PagedKVCache(spec, 8, ("float32", "float32"))
    table = cache.allocator.allocate(3)[::-1]  # a non-monotonic table: [2, 1, 0]
    k, v = _kv(10, 2, 4, seed=2)
    cache.layers[1].write(cache.slots_for(table, 0, 10), k, v)
    rk, rv = cache.read_tokens(1, table, 10, torch.float32)
    assert torch.equal(rk, k) and torch.equal(rv, v)
    first = cache.layers[0]
    assert isinstance(first, DenseLayerStorage) and not first.k.any()  # layers are independent
    cache.allocator.free(table)
    assert cache.allocator.num_free == 8


@pytest.mark.parametrize("dtype_name", ["int8", "fp8"])
@pytest.mark.parametrize("compute_dtype", [torch.float32, torch.bfloat16])
def test_quantized_write_gather_within_bound(dtype_name: CacheDType, compute_dtype: torch.dtype) -> None:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=4, head_dim=64, block_size=16)
    store = QuantizedLayerStorage(spec, 8, dtype_name, CPU)
    k, v = _kv(100, 4, 64, seed=3)
    k, v = k.to(compute_dtype), v.to(compute_dtype)
    slots = torch.randperm(128, generator=torch.Generator().manual_seed(4))[:100]
    store.write(slots, k, v)
    gk, gv = store.gather(slots, torch.float32)
    assert gk.dtype == torch.float32 and gk.shape == k.shape
    for x, y in ((k.float(), gk), (v.float(), gv)):
        err = (x - y).abs()
        amax = x.abs().amax(dim=-1, keepdim=True)
        if dtype_name == "int8":
            assert (err <= amax / 127 / 2 * SLACK + 1e-30).all()
        else:
            assert (err <= (x.abs() * 2**-4 + 2**-10 * amax / 448) * SLACK + 1e-30).all()
            assert (err <= amax / 28 * SLACK).all()
            assert (err <= amax * 2**-3).all()
        # the bound is not vacuous: the row maximum survives almost exactly
        assert torch.allclose(y.abs().amax(dim=-1, keepdim=True), amax, rtol=1e-5)
    # gather in the compute dtype too
    assert store.gather(slots[:3], compute_dtype)[0].dtype == compute_dtype


@pytest.mark.parametrize("dtype_name", ["int8", "fp8"])
def test_quantized_zeros_and_scale_per_token_head(dtype_name: CacheDType) -> None:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=2, head_dim=8, block_size=4)
    store = QuantizedLayerStorage(spec, 2, dtype_name, CPU)
    k = torch.zeros(2, 2, 8)
    k[1, 0] = torch.linspace(-1000.0, 1000.0, 8)
    k[1, 1] = torch.linspace(-1e-3, 1e-3, 8)  # a tiny head next to a huge one keeps its own scale
    store.write(torch.tensor([5, 2]), k, -k)
    gk, gv = store.gather(torch.tensor([5, 2]), torch.float32)
    assert not gk[0].any() and not gv[0].any()  # all-zero rows round-trip to zero, not NaN
    rel = 2**-4 if dtype_name == "fp8" else 1 / 127
    assert torch.allclose(gk[1, 1], k[1, 1], rtol=rel, atol=1e-3 / 127)
    assert torch.allclose(gv[1, 0], -k[1, 0], rtol=rel, atol=1000 / 127)
    assert store.k_scale[2, 0] / store.k_scale[2, 1] == pytest.approx(1e6, rel=1e-3)  # scale per (token, head)


def test_slot_list_equals_the_cache_s_slot_tensor_for_any_span() -> None:
    """The step builder's int slot list equals PagedKVCache.slots_for's tensor formula on random spans."""
    import random

    from workers.runtime.attention import slot_list

    rng = random.Random(0)
    for _ in range(300):
        bs = rng.choice([1, 4, 16])
        table = rng.sample(range(1000), rng.randint(1, 12))
        total = len(table) * bs
        start = rng.randint(0, total)
        end = rng.randint(start, total)
        pos = torch.arange(start, end)
        expected = (torch.tensor(table, dtype=torch.long)[pos // bs] * bs + pos % bs).tolist()
        assert slot_list(table, start, end, bs) == expected, (table, bs, start, end)


def _quantized_write(dtype_name: CacheDType, device: torch.device) -> QuantizedLayerStorage:
    spec = KVCacheSpec(num_layers=1, num_kv_heads=4, head_dim=64, block_size=16)
    store = QuantizedLayerStorage(spec, 8, dtype_name, device)
    k, v = _kv(128, 4, 64, seed=11)
    k = k * torch.logspace(-6, 6, 128).view(128, 1, 1)  # amaxes over many binades: many rounding cases
    store.write(torch.arange(128, device=device), k.to(device), v.to(device))
    return store


@pytest.mark.parametrize("dtype_name", ["int8", "fp8"])
def test_quantized_scale_is_the_exact_quotient(dtype_name: CacheDType) -> None:
    """scale = amax / qmax rounded once (IEEE division), which the Triton KV write and the requantising
    landing also compute; a multiply by the reciprocal differs in the last bit for some amaxes."""
    store = _quantized_write(dtype_name, CPU)
    k, _ = _kv(128, 4, 64, seed=11)
    k = k * torch.logspace(-6, 6, 128).view(128, 1, 1)
    amax = k.abs().amax(dim=-1).clamp_min(1e-12).numpy()
    qmax = np.float32(127.0 if dtype_name == "int8" else 448.0)
    exact = torch.from_numpy(amax / qmax)
    by_reciprocal = torch.from_numpy(amax * (np.float32(1.0) / qmax))
    assert torch.equal(store.k_scale, exact)
    assert not torch.equal(exact, by_reciprocal)  # the check can tell the two apart on this input


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype_name", ["int8", "fp8"])
def test_quantized_write_on_cuda_equals_cpu_bit_for_bit(dtype_name: CacheDType) -> None:
    cpu, gpu = _quantized_write(dtype_name, CPU), _quantized_write(dtype_name, torch.device("cuda"))
    for a, b in ((cpu.k, gpu.k), (cpu.v, gpu.v), (cpu.k_scale, gpu.k_scale), (cpu.v_scale, gpu.v_scale)):
        assert torch.equal(a.view(torch.uint8) if a.dtype != torch.float32 else a,
                           (b.view(torch.uint8) if b.dtype != torch.float32 else b).cpu())
