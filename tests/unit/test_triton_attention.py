"""Paged attention kernels against the torch gather path (``attention.paged_attention``)."""

from __future__ import annotations

import pytest
import torch

from tests.unit.triton_env import DEVICE
from workers.runtime.attention import DecodeItem, PrefillItem, build_step_batch, make_prefill_tiles, paged_attention
from workers.runtime.kernels.cache_views import cache_tensors
from workers.runtime.kernels.paged_attention import paged_decode_attention, paged_prefill_attention
from workers.runtime.kernels.split_decode import num_splits, split_decode_attention
from workers.runtime.kv_cache import CacheDType, KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.unit
HEAD_DIM = 16
KV_HEADS = 2
TOL = {torch.float32: 2e-5, torch.bfloat16: 3e-2, torch.float16: 4e-3}


def _cache(block_size: int, cache_dtype: CacheDType, num_blocks: int = 32) -> PagedKVCache:
    cache = PagedKVCache(KVCacheSpec(1, KV_HEADS, HEAD_DIM, block_size), num_blocks, (cache_dtype,), DEVICE)
    gen = torch.Generator().manual_seed(1)
    slots = torch.arange(num_blocks * block_size)
    k, v = (torch.randn(len(slots), KV_HEADS, HEAD_DIM, generator=gen) for _ in range(2))
    cache.layers[0].write(slots.to(DEVICE), k.to(DEVICE), v.to(DEVICE))
    return cache


def _tables(cache: PagedKVCache, lengths: list[int]) -> list[list[int]]:
    """Scattered block tables: sequences share no block and their blocks are not in order."""
    perm = torch.randperm(cache.num_blocks, generator=torch.Generator().manual_seed(2)).tolist()
    tables, used = [], 0
    for n in lengths:
        k = max(1, cache.blocks_for(n))
        tables.append(perm[used:used + k])
        used += k
    return tables


def _padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(len(t) for t in tables)
    return torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=DEVICE)


CASES = [  # (query heads, block size, cache dtype, compute dtype)
    (2, 16, "float32", torch.float32), (4, 16, "float32", torch.float32), (8, 32, "float32", torch.float32),
    (4, 16, "bfloat16", torch.bfloat16), (4, 32, "float16", torch.float16), (4, 16, "float32", torch.bfloat16),
    (4, 16, "int8", torch.float32), (8, 32, "int8", torch.bfloat16), (4, 16, "fp8", torch.float32),
    (2, 32, "fp8", torch.bfloat16), (4, 8, "float32", torch.float32), (8, 128, "bfloat16", torch.bfloat16),
]


@pytest.mark.parametrize("heads,block_size,cache_dtype,dtype", CASES)
def test_decode_matches_gather_path(heads: int, block_size: int, cache_dtype: CacheDType, dtype: torch.dtype) -> None:
    cache = _cache(block_size, cache_dtype)
    lengths = [1, block_size + 3, 2 * block_size, 5, 70]  # ragged, one on a block boundary, one > a tile
    tables = _tables(cache, lengths)
    q = torch.randn(len(lengths), heads, HEAD_DIM, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    batch = build_step_batch([DecodeItem(0, n - 1, t) for n, t in zip(lengths, tables)], [], cache)
    want = paged_attention(q, q, q, batch, cache.layers[0], HEAD_DIM ** -0.5)
    got = torch.full_like(q, float("nan"))
    seq_lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    paged_decode_attention(q, cache_tensors(cache.layers[0]), _padded(tables), seq_lens, HEAD_DIM ** -0.5,
                           block_size, got)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_decode_padded_rows_are_zero_and_others_unchanged() -> None:
    """A bucket's padded rows (length 0) read nothing and give zeros; the real rows are as alone."""
    cache = _cache(16, "bfloat16")
    tables = _tables(cache, [7, 20])
    q = torch.randn(4, 4, HEAD_DIM, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    bt = torch.cat([_padded(tables), torch.full((2, 2), -1, dtype=torch.int32, device=DEVICE)])
    out = torch.full_like(q, float("nan"))
    lens = torch.tensor([7, 20, 0, 0], dtype=torch.int32, device=DEVICE)
    paged_decode_attention(q, cache_tensors(cache.layers[0]), bt, lens, 0.25, 16, out)
    alone = torch.empty_like(q[:2])
    paged_decode_attention(q[:2], cache_tensors(cache.layers[0]), _padded(tables), lens[:2], 0.25, 16, alone)
    assert torch.equal(out[2:], torch.zeros_like(out[2:]))
    assert torch.equal(out[:2], alone)


@pytest.mark.parametrize("heads,block_size,cache_dtype,dtype", [c for c in CASES if c[1] != 32 or c[0] == 8])
def test_prefill_over_cached_context_matches_gather_path(heads: int, block_size: int, cache_dtype: CacheDType,
                                                         dtype: torch.dtype) -> None:
    """Chunks with cached context (chunked prefill, a prefix hit) attend through the block tables."""
    cache = _cache(block_size, cache_dtype)
    chunks = [(block_size + 5, 20), (3, 1), (2 * block_size, 17), (50, 30)]  # (context, chunk tokens), ragged
    tables = _tables(cache, [c + n for c, n in chunks])
    total = sum(n for _, n in chunks)
    q = torch.randn(total, heads, HEAD_DIM, generator=torch.Generator().manual_seed(5)).to(DEVICE, dtype)
    items = [PrefillItem([0] * n, c, t, want_logits=False) for (c, n), t in zip(chunks, tables)]
    batch = build_step_batch([], items, cache)
    want = paged_attention(q, q, q, batch, cache.layers[0], HEAD_DIM ** -0.5)
    starts = [s.token_start for s in batch.prefills]
    tiles = make_prefill_tiles([(i, st, n, c) for i, (st, (c, n)) in enumerate(zip(starts, chunks))], DEVICE)
    got = torch.full_like(q, float("nan"))
    paged_prefill_attention(q, cache_tensors(cache.layers[0]), _padded(tables), tiles, HEAD_DIM ** -0.5,
                            block_size, got)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_prefill_of_a_fresh_prompt_matches_causal_sdpa() -> None:
    cache = _cache(16, "float32")
    n = 21
    (table,) = _tables(cache, [n])
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(n, h, HEAD_DIM, generator=gen).to(DEVICE) for h in (4, KV_HEADS, KV_HEADS))
    batch = build_step_batch([], [PrefillItem([0] * n, 0, table, want_logits=False)], cache)
    cache.layers[0].write(batch.slot_mapping, k, v)
    want = paged_attention(q, k, v, batch, cache.layers[0], 0.25)
    got = torch.empty_like(q)
    paged_prefill_attention(q, cache_tensors(cache.layers[0]), _padded([table]),
                            make_prefill_tiles([(0, 0, n, 0)], DEVICE), 0.25, 16, got)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                               ("int8", torch.float32), ("fp8", torch.bfloat16)])
@pytest.mark.parametrize("splits", [2, 3])
def test_split_context_decode_matches_the_single_pass(cache_dtype: CacheDType, dtype: torch.dtype,
                                                      splits: int) -> None:
    """Splitting each context over programs and merging changes nothing beyond rounding, with rows of
    length 0, rows shorter than a split, and splits past a row's end."""
    cache = _cache(16, cache_dtype, num_blocks=40)
    lengths = [200, 1, 0, 70, 129]
    tables = _tables(cache, lengths)
    q = torch.randn(len(lengths), 8, HEAD_DIM, generator=torch.Generator().manual_seed(7)).to(DEVICE, dtype)
    lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
    want, got = torch.empty_like(q), torch.full_like(q, float("nan"))
    paged_decode_attention(q, cache_tensors(cache.layers[0]), _padded(tables), lens, 0.25, 16, want)
    split_decode_attention(q, cache_tensors(cache.layers[0]), _padded(tables), lens, 0.25, 16, got, splits)
    torch.testing.assert_close(got.float(), want.float(), atol=TOL[dtype], rtol=TOL[dtype])
    assert torch.equal(got[2], torch.zeros_like(got[2]))


def test_num_splits_spreads_long_contexts_of_small_batches_only() -> None:
    assert num_splits(1, 4, 512, 16) == 1  # short contexts keep the single pass
    assert num_splits(1, 4, 4096, 16) == 16
    assert num_splits(8, 4, 4096, 16) == 4
    assert num_splits(64, 4, 4096, 16) == 1


def test_the_kernel_ops_split_long_contexts_and_match_the_gather_path() -> None:
    from workers.runtime.kernels.ops import TritonOps

    cache = _cache(16, "float32", num_blocks=80)
    lengths = [600, 37]
    tables = _tables(cache, lengths)
    batch = build_step_batch([DecodeItem(0, n - 1, t) for n, t in zip(lengths, tables)], [], cache, paged_kernels=True)
    assert batch.kernel is not None and batch.kernel.max_context == 600
    assert num_splits(2, KV_HEADS, 600, 16) > 1
    q = torch.randn(2, 4, HEAD_DIM, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    got = TritonOps(16).attention(q, q, q, batch, cache.layers[0], 0.25)
    torch_batch = build_step_batch([DecodeItem(0, n - 1, t) for n, t in zip(lengths, tables)], [], cache)
    want = paged_attention(q, q, q, torch_batch, cache.layers[0], 0.25)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("cache_dtype", ["float32", "bfloat16", "int8"])
@pytest.mark.parametrize("path", ["gather", "kernel", "split"])
def test_non_finite_values_outside_a_sequence_never_reach_it(cache_dtype: CacheDType, path: str) -> None:
    """NaN or inf in the cache (a wrong sender's float payload, an overflow in another request, or the stale
    tail of a block a poisoned request freed) reaches no sequence that does not own it: a decode row shorter
    than the batch's longest reads past its own end only at positions it masks, and a masked score times a
    NaN value is still NaN. Here every slot but the ones sequence 0 holds is NaN (block 0, which pads the
    shorter tables, and the unused tail of its own last block included); its output is what a clean cache
    gives."""
    block_size, lengths = 16, [7, 40]
    clean = _cache(block_size, cache_dtype)
    tables = [[3], [0, 5, 9]]  # sequence 1 holds block 0, the padding block
    poisoned = _cache(block_size, cache_dtype)
    owned = set(range(3 * block_size, 3 * block_size + lengths[0]))
    others = torch.tensor([s for s in range(poisoned.num_blocks * block_size) if s not in owned], device=DEVICE)
    nan = torch.full((len(others), KV_HEADS, HEAD_DIM), float("nan"), device=DEVICE)
    poisoned.layers[0].write(others, nan, nan)
    q = torch.randn(2, 4, HEAD_DIM, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    items = [DecodeItem(0, n - 1, t) for n, t in zip(lengths, tables)]

    def decode(cache: PagedKVCache) -> torch.Tensor:
        if path == "gather":
            return paged_attention(q, q, q, build_step_batch(items, [], cache), cache.layers[0], 0.25)
        out = torch.full_like(q, float("nan"))
        lens = torch.tensor(lengths, dtype=torch.int32, device=DEVICE)
        if path == "kernel":
            paged_decode_attention(q, cache_tensors(cache.layers[0]), _padded(tables), lens, 0.25, block_size, out)
        else:
            split_decode_attention(q, cache_tensors(cache.layers[0]), _padded(tables), lens, 0.25, block_size, out, 2)
        return out
    got, want = decode(poisoned), decode(clean)
    assert torch.isfinite(got[0]).all(), got[0]
    torch.testing.assert_close(got[0], want[0], atol=0, rtol=0)
    assert not torch.equal(got[1], want[1])  # sequence 1 reads its own NaN: that one is its own
