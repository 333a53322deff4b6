"""The KV write and the fused small-op kernels against the torch path they replace on a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.unit.triton_env import DEVICE  # first: sets TRITON_INTERPRET before any kernel is defined
from workers.runtime.config import RopeConfig
from workers.runtime.kernels.cache_views import cache_tensors
from workers.runtime.kernels.fp8 import e4m3_to_f32, f32_to_e4m3
from workers.runtime.kernels.fused import add_rmsnorm, rmsnorm, rope_, silu_mul
from workers.runtime.kernels.kv_write import rope_write_kv, write_kv
from workers.runtime.kv_cache import CacheDType, KVCacheSpec, PagedKVCache
from workers.runtime.model import RMSNorm
from workers.runtime.rope import RotaryEmbedding

pytestmark = pytest.mark.unit
triton = pytest.importorskip("triton")  # after triton_env, so the kernel below is defined as it says
tl = triton.language


def _pool(cache_dtype: CacheDType) -> PagedKVCache:
    return PagedKVCache(KVCacheSpec(1, 3, 16, 16), 4, (cache_dtype,), DEVICE)


def _state(cache: PagedKVCache) -> list[torch.Tensor]:
    s = cache.layers[0]
    return [getattr(s, n).view(torch.uint8).clone() for n in ("k", "v")] + [
        getattr(s, n).clone() for n in ("k_scale", "v_scale") if hasattr(s, n)]


@pytest.mark.parametrize("cache_dtype,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                               ("float16", torch.bfloat16), ("int8", torch.float32),
                                               ("int8", torch.bfloat16), ("fp8", torch.float32),
                                               ("fp8", torch.bfloat16)])
def test_kv_write_stores_what_storage_write_stores(cache_dtype: CacheDType, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(0)
    # k comes from a fused qkv matmul in the model: a strided view, as here.
    qkv = (torch.randn(6, 2 * 3 * 16, generator=gen) * 3).to(DEVICE, dtype)
    k, v = qkv[:, :48].view(6, 3, 16), qkv[:, 48:].view(6, 3, 16)
    k[0, 1] = 0.0  # an all-zero head: the 1e-12 floor keeps its scale finite
    slots = torch.tensor([5, 17, 0, 63, 40, 2], device=DEVICE)
    want, got = _pool(cache_dtype), _pool(cache_dtype)
    want.layers[0].write(slots, k, v)
    write_kv(cache_tensors(got.layers[0]), slots, k, v)
    for a, b in zip(_state(got), _state(want)):
        assert torch.equal(a, b)


def test_kv_write_skips_padded_slots() -> None:
    cache = _pool("int8")
    before = _state(cache)
    k = torch.randn(3, 3, 16).to(DEVICE)
    write_kv(cache_tensors(cache.layers[0]), torch.tensor([-1, -1, -1], device=DEVICE), k, k)
    assert all(torch.equal(a, b) for a, b in zip(_state(cache), before))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rmsnorm_and_residual_add(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    norm = RMSNorm(40, 1e-5, dtype, DEVICE)
    norm.weight.copy_(torch.randn(40, generator=gen))
    x, r = (torch.randn(5, 40, generator=gen).to(DEVICE, dtype) for _ in range(2))
    atol, rtol = (1e-5, 1e-5) if dtype == torch.float32 else (2e-2, 1e-2)
    torch.testing.assert_close(rmsnorm(x, norm.weight, 1e-5), norm(x), atol=atol, rtol=rtol)
    h, out = add_rmsnorm(x, r, norm.weight, 1e-5)
    # One bf16 ulp: Triton's interpreter truncates float32 -> bf16 where a GPU rounds to nearest.
    torch.testing.assert_close(h, r + x, atol=0, rtol=0 if dtype == torch.float32 else 2 ** -7)
    torch.testing.assert_close(out, norm(r + x), atol=atol, rtol=rtol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_in_place_matches_rotary_embedding(dtype: torch.dtype) -> None:
    rotary = RotaryEmbedding(RopeConfig(), 16, DEVICE)
    cos, sin = rotary.cos_sin(torch.tensor([0, 3, 9, 100], device=DEVICE), dtype)
    qkv = torch.randn(4, 5 * 16, generator=torch.Generator().manual_seed(2)).to(DEVICE, dtype)
    q = qkv[:, :48].view(4, 3, 16)
    want = RotaryEmbedding.apply(q, cos, sin)
    rope_(q, cos, sin)
    tol = 1e-6 if dtype == torch.float32 else 2 ** -7  # one bf16 ulp, as above
    torch.testing.assert_close(q, want, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul(dtype: torch.dtype) -> None:
    gate_up = torch.randn(3, 2 * 24, generator=torch.Generator().manual_seed(3)).to(DEVICE, dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    tol = 1e-6 if dtype == torch.float32 else 1e-2
    torch.testing.assert_close(silu_mul(gate_up), F.silu(gate) * up, atol=tol, rtol=tol)


@triton.jit
def _fp8_roundtrip(bytes_ptr, decoded_ptr, x_ptr, encoded_ptr, n, BLOCK: tl.constexpr):  # type: ignore[name-defined]  # tl is importorskip's module, not a name mypy resolves
    i = tl.arange(0, BLOCK)
    mask = i < n
    tl.store(decoded_ptr + i, e4m3_to_f32(tl.load(bytes_ptr + i, mask=mask, other=0)), mask=mask)
    tl.store(encoded_ptr + i, f32_to_e4m3(tl.load(x_ptr + i, mask=mask, other=0.0)), mask=mask)


def test_fp8_conversions_match_torch_bit_for_bit() -> None:
    patterns = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)  # all but NaN
    exact = patterns.view(torch.float8_e4m3fn).float()
    mids = (exact.sort().values[1:] + exact.sort().values[:-1]) / 2  # every tie between neighbours
    gen = torch.Generator().manual_seed(4)
    x = torch.cat([exact, mids, torch.randn(600, generator=gen) * 60, torch.randn(200, generator=gen) * 0.01,
                   torch.tensor([-0.0, 448.0, -448.0, 1e-30])]).clamp(-448, 448)
    n = max(len(patterns), len(x))
    pad = torch.zeros(n - len(patterns), dtype=torch.uint8)
    bytes_in = torch.cat([patterns, pad]).to(DEVICE)
    decoded = torch.empty(n, device=DEVICE)
    encoded = torch.empty(len(x), dtype=torch.uint8, device=DEVICE)
    _fp8_roundtrip[(1,)](bytes_in, decoded, x.to(DEVICE), encoded, n, BLOCK=triton.next_power_of_2(n))
    assert torch.equal(decoded[:len(patterns)].cpu(), exact)
    assert torch.equal(encoded.cpu(), x.to(torch.float8_e4m3fn).view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_gives_zeros_the_sign_torch_gives_them(dtype: torch.dtype) -> None:
    """Where both halves of a pair are signed zeros the rotated value is a zero whose sign follows IEEE's
    rules for x1 * cos - x2 * sin; the kernel must give torch's sign (a negation lowered to 0 - x, as
    triton 3.6 does, makes -(+0) +0 and flips some of them)."""
    rotary = RotaryEmbedding(RopeConfig(), 16, DEVICE)
    positions = torch.tensor([0, 2, 3, 5], device=DEVICE)  # cos and sin of both signs among them
    cos, sin = rotary.cos_sin(positions, dtype)
    signs = torch.tensor([[a, b] for a in (0.0, -0.0) for b in (0.0, -0.0)])  # every (x1, x2) pair of zeros
    x = torch.zeros(4, 2, 16)
    for h in range(2):
        for i in range(8):
            x[:, h, i], x[:, h, 8 + i] = signs[(h * 8 + i) % 4]
    x = x.to(DEVICE, dtype)
    want = RotaryEmbedding.apply(x.clone(), cos, sin)
    got = x.clone()
    rope_(got, cos, sin)
    assert bool((want == 0).all()) and bool((got == 0).all())
    assert torch.equal(torch.signbit(got).cpu(), torch.signbit(want).cpu())
    assert bool(torch.signbit(want).any()) and not bool(torch.signbit(want).all())


@pytest.mark.parametrize("cache_dtype,dtype", [("float32", torch.float32), ("bfloat16", torch.bfloat16),
                                               ("int8", torch.float32), ("int8", torch.bfloat16),
                                               ("fp8", torch.bfloat16)])
def test_rope_write_kv_is_rope_then_the_storage_write(cache_dtype: CacheDType, dtype: torch.dtype) -> None:
    """The fused kernel the decoder runs: q and k rotated in place, k and v stored; slot -1 skipped."""
    rotary = RotaryEmbedding(RopeConfig(), 16, DEVICE)
    positions = torch.tensor([0, 3, 9, 100, 7], device=DEVICE)
    cos, sin = rotary.cos_sin(positions, dtype)
    qkv = (torch.randn(5, (4 + 2 * 3) * 16, generator=torch.Generator().manual_seed(5)) * 3).to(DEVICE, dtype)
    slots = torch.tensor([5, 17, -1, 63, 40], device=DEVICE)
    q, k, v = qkv[:, :64].view(5, 4, 16), qkv[:, 64:112].view(5, 3, 16), qkv[:, 112:].view(5, 3, 16)
    want_q, want_k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
    got, want = _pool(cache_dtype), _pool(cache_dtype)
    rope_write_kv(cache_tensors(got.layers[0]), slots, qkv[:, :112].view(5, 7, 16), v, cos, sin, 4)
    # bf16: the interpreter truncates each of RoPE's three roundings (a GPU rounds to nearest, as torch):
    # up to about one ulp of the inputs (|x| < 16 here: 0.0625) when the two products cancel.
    atol, rtol = (1e-6, 1e-6) if dtype == torch.float32 else (0.07, 2 ** -7)
    torch.testing.assert_close(q, want_q, atol=atol, rtol=rtol)
    torch.testing.assert_close(k, want_k, atol=atol, rtol=rtol)
    keep = slots >= 0  # the cache holds exactly what the storage's own write stores for the rotated k
    want.layers[0].write(slots[keep], k[keep], v[keep])
    for a, b in zip(_state(got), _state(want)):
        assert torch.equal(a, b)
