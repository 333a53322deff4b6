"""The fused landing kernel of a non-native codec in a quantised decode layer
(workers.runtime.kernels.kv_requant) against the path it replaces, bit for bit: decode to float32 with the
torch codec, then ``QuantizedLayerStorage.write``, on CPU.

Without CUDA the kernel runs on CPU through Triton's interpreter (tests.unit.triton_env); with CUDA the same
tests run it compiled on a CUDA cache (``make gpu-check`` lists this file), the reference staying on CPU.
Sizes stay tiny: the interpreter runs each program in Python.
"""

from __future__ import annotations

import pytest
import torch

from kvtransfer.codecs import CodecError, EncodedTensor, Kind, get_codec
from tests.unit.triton_env import DEVICE
from workers.runtime.kv_cache import CacheDType, DenseLayerStorage, KVCacheSpec, QuantizedLayerStorage, block_slots

pytestmark = pytest.mark.unit

CPU = torch.device("cpu")
CODECS = ["int8", "fp8", "int4", "bf16", "fp32"]
CACHES: list[CacheDType] = ["int8", "fp8"]
# (num_blocks in the cache, block_size, kv_heads, head_dim): head_dim 6 exercises the masks, 3 heads a head count
# that is not a power of two, block 64 the token loop and int4's two key groups per block.
SHAPES = [(6, 4, 2, 8), (4, 2, 3, 64), (4, 64, 1, 4), (5, 1, 1, 6)]
IDS = [2, 0, 3]  # out of order, with gaps: blocks are addressed by index


def _spec(cache_shape: tuple[int, int, int, int]) -> KVCacheSpec:
    _, bs, h, d = cache_shape
    return KVCacheSpec(num_layers=1, num_kv_heads=h, head_dim=d, block_size=bs)


def _storage(cache_shape: tuple[int, int, int, int], dtype: CacheDType, device: torch.device) -> QuantizedLayerStorage:
    """A layer whose codes and scales all hold a sentinel, so a write outside the ids (or any write at all
    after a refusal) shows."""
    s = QuantizedLayerStorage(_spec(cache_shape), cache_shape[0], dtype, device)
    for t in (s.k, s.v):
        t.view(torch.uint8).fill_(0x35)
    for t in (s.k_scale, s.v_scale):
        t.fill_(5.0)
    return s


def _reference(codec: str, key: EncodedTensor, value: EncodedTensor, cache_shape: tuple[int, int, int, int],
               ids: list[int], dtype: CacheDType) -> QuantizedLayerStorage:
    """The torch path, on CPU: the codec's float32 decode, then the cache's own per-(token, head) write."""
    c = get_codec(codec)
    s = _storage(cache_shape, dtype, CPU)
    _, bs, h, d = cache_shape
    k, v = c.decode(key, torch.float32), c.decode(value, torch.float32)
    s.write(block_slots(ids, bs, CPU), k.reshape(-1, h, d), v.reshape(-1, h, d))
    return s


def _on_device(enc: EncodedTensor) -> EncodedTensor:
    return EncodedTensor(enc.codec_id, enc.kind, enc.shape, enc.payload.to(DEVICE), enc.scales.to(DEVICE),
                         None if enc.zeros is None else enc.zeros.to(DEVICE))


def _land(codec: str, key: EncodedTensor, value: EncodedTensor, cache_shape: tuple[int, int, int, int],
          ids: list[int], dtype: CacheDType) -> QuantizedLayerStorage:
    from workers.runtime.kernels.kv_requant import land_requantised  # after triton_env: interpreted without CUDA

    s = _storage(cache_shape, dtype, DEVICE)
    land_requantised(get_codec(codec), _on_device(key), _on_device(value), s, cache_shape[1],
                     torch.tensor(ids, dtype=torch.long, device=DEVICE))
    return s


def _assert_same_cache(want: QuantizedLayerStorage, got: QuantizedLayerStorage) -> None:
    assert got.k.device.type == DEVICE.type
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(want, name).view(torch.uint8), getattr(got, name).cpu().view(torch.uint8)
        assert torch.equal(a, b), f"{name}: {int((a != b).sum())} bytes differ"


def _kv(cache_shape: tuple[int, int, int, int], n: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Random keys and values at very different magnitudes per block (tiny, normal, large), so both the
    codec's scales and the cache's per-token scales differ."""
    gen = torch.Generator().manual_seed(seed)
    mags = torch.tensor([1e-3, 1.0, 300.0, 2.0**-30, 7.0, 1e4])[:n].view(-1, 1, 1, 1)
    shape = (n, *cache_shape[1:])
    return torch.randn(shape, generator=gen) * mags, torch.randn(shape, generator=gen) * mags


def _ids(cache_shape: tuple[int, int, int, int]) -> list[int]:
    return [i for i in IDS if i < cache_shape[0]]


@pytest.mark.parametrize("dtype", CACHES)
@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("cache_shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_lands_what_decode_then_storage_write_lands(codec: str, dtype: CacheDType,
                                                    cache_shape: tuple[int, int, int, int]) -> None:
    ids = _ids(cache_shape)
    for src_dtype, seed in ((torch.float32, 1), (torch.bfloat16, 2)):
        k, v = _kv(cache_shape, len(ids), seed)
        c = get_codec(codec)
        key, value = c.encode(k.to(src_dtype), Kind.KEY), c.encode(v.to(src_dtype), Kind.VALUE)
        want = _reference(codec, key, value, cache_shape, ids, dtype)
        _assert_same_cache(want, _land(codec, key, value, cache_shape, ids, dtype))


def _random_parts(codec: str, kind: Kind, shape: tuple[int, int, int, int], gen: torch.Generator) -> EncodedTensor:
    """Received parts made of random bits, every decoded value finite: int8 codes -128..127 (-128 no encoder
    sends), any fp8 code but NaN's, bf16/fp32 of any exponent (subnormals too), float32 scales over 2^+-40 of
    either sign, float16 scales and zeros of any finite value."""
    c = get_codec(codec)
    layout = c.layout(shape, kind)
    p = torch.randint(0, 256, (layout.payload_nbytes,), dtype=torch.uint8, generator=gen)
    if codec == "fp8":
        p[(p & 0x7F) == 0x7F] = 0x11
    elif codec == "bf16":
        w16 = p.view(torch.int16)
        w16[(w16 & 0x7F80) == 0x7F80] &= ~0x4000
    elif codec == "fp32":
        w32 = p.view(torch.int32)
        w32[(w32 & 0x7F800000) == 0x7F800000] &= ~0x40000000
    count = 1
    for dim in layout.scales_shape:
        count *= dim

    def f16() -> torch.Tensor:
        b = torch.randint(0, 1 << 16, (count,), dtype=torch.int32, generator=gen).to(torch.int16)
        b[(b & 0x7C00) == 0x7C00] &= ~0x4000
        return b.view(torch.float16).view(layout.scales_shape)

    if codec in ("int8", "fp8"):
        exp = torch.randint(-40, 40, (count,), generator=gen).float()
        scales = ((torch.rand(count, generator=gen) * 2 - 1) * torch.pow(2.0, exp)).view(layout.scales_shape)
    elif codec == "int4":
        scales = f16()
    else:
        scales = torch.empty(0)
    zeros = f16() if codec == "int4" else None
    return EncodedTensor(c.codec_id, kind, shape, p, scales, zeros)


@pytest.mark.parametrize("dtype", CACHES)
@pytest.mark.parametrize("codec", CODECS)
def test_random_received_bits_land_as_the_torch_path_lands(codec: str, dtype: CacheDType) -> None:
    """Not only what an encoder sends: any finite decoded value (subnormal inputs, values far below the
    cache's 1e-12 scale floor, negative scales) rounds as the torch path rounds it."""
    gen = torch.Generator().manual_seed(7)
    for cache_shape in ((4, 4, 2, 8), (3, 32, 3, 64)):
        ids = _ids(cache_shape)
        shape = (len(ids), *cache_shape[1:])
        key, value = _random_parts(codec, Kind.KEY, shape, gen), _random_parts(codec, Kind.VALUE, shape, gen)
        for part in (key, value):
            assert bool(torch.isfinite(get_codec(codec).decode(part, torch.float32)).all())
        want = _reference(codec, key, value, cache_shape, ids, dtype)
        _assert_same_cache(want, _land(codec, key, value, cache_shape, ids, dtype))


@pytest.mark.parametrize("dtype", CACHES)
def test_ties_signed_zero_and_the_scale_floor(dtype: CacheDType) -> None:
    """Rows built to hit the rounding's edges: amax 127 (int8: scale 1, so x / s lands on .5 ties) and 448
    (fp8: ties between e4m3 values and in its subnormals), -0, an all-zero row and one below the 1e-12 floor."""
    cache_shape = (3, 2, 2, 8)
    rows = [[127.0, 0.5, 1.5, 2.5, -2.5, -0.0, 126.5, -126.5],
            [448.0, 17.0, 19.0, -17.0, 1.5 * 2.0**-9, -0.0, 0.5 * 2.0**-9, 2.5 * 2.0**-9],
            [0.0] * 8,
            [1e-13, -3e-13, 5e-14, 0.0, -0.0, 1e-15, 2e-13, 1e-12]]
    x = torch.tensor(rows, dtype=torch.float32)
    k = x[torch.arange(8) % 4].view(2, 2, 2, 8)
    v = x[(torch.arange(8) + 1) % 4].view(2, 2, 2, 8)
    c = get_codec("fp32")
    key, value = c.encode(k, Kind.KEY), c.encode(v, Kind.VALUE)
    want = _reference("fp32", key, value, cache_shape, [2, 0], dtype)
    _assert_same_cache(want, _land("fp32", key, value, cache_shape, [2, 0], dtype))


def _corrupt(codec: str, enc: EncodedTensor, how: str) -> EncodedTensor:
    """``enc`` with one element, or one scale, changed so that it decodes to NaN or inf."""
    p, s, z = enc.payload.clone(), enc.scales.clone(), None if enc.zeros is None else enc.zeros.clone()
    if how == "payload" and codec == "fp32":
        p.view(torch.float32)[5] = float("inf")
    elif how == "payload" and codec == "bf16":
        p.view(torch.int16)[5] = 0x7FC0  # NaN
    elif how == "payload" and codec == "fp8":
        p[5] = 0xFF  # e4m3fn's NaN
    elif how == "payload" and codec == "int8":
        p.view(torch.int8)[5] = -128  # -128 * a scale near float32's max overflows
        s.view(-1)[0] = 3.0e38
    elif how == "scale":
        s.view(-1)[0] = float("nan")
    elif how == "zero":
        assert z is not None
        z.view(-1)[0] = float("-inf")
    return EncodedTensor(enc.codec_id, enc.kind, enc.shape, p, s, z)


# The int8 case overflows float32 on purpose (-128 * 3e38, as the torch decode does); under the interpreter
# numpy warns of that, which the suite's warnings-as-errors would turn into a different failure.
_OVERFLOW = pytest.mark.filterwarnings("ignore:overflow encountered in multiply:RuntimeWarning")


@pytest.mark.parametrize("codec, how", [("fp32", "payload"), ("bf16", "payload"), ("fp8", "payload"),
                                        pytest.param("int8", "payload", marks=_OVERFLOW), ("int8", "scale"),
                                        ("fp8", "scale"), ("int4", "scale"), ("int4", "zero")])
@pytest.mark.parametrize("dtype", CACHES)
def test_non_finite_received_values_are_refused_and_nothing_is_written(codec: str, how: str,
                                                                       dtype: CacheDType) -> None:
    """Only the values are corrupt, in their first block: the keys and the other blocks are clean, and still
    nothing lands."""
    cache_shape = (6, 4, 2, 8)
    ids = _ids(cache_shape)
    k, v = _kv(cache_shape, len(ids), 3)
    c = get_codec(codec)
    key, value = c.encode(k, Kind.KEY), _corrupt(codec, c.encode(v, Kind.VALUE), how)
    assert not bool(torch.isfinite(c.decode(value, torch.float32)).all())
    with pytest.raises(CodecError, match=rf"{codec}: the received KV holds NaN or inf once decoded; refusing to "
                                         rf"land it in the {dtype} cache \(nothing was written\)"):
        _land(codec, key, value, cache_shape, ids, dtype)
    # _land's storage is gone with the exception: land again into one kept here
    from workers.runtime.kernels.kv_requant import land_requantised

    s = _storage(cache_shape, dtype, DEVICE)
    with pytest.raises(CodecError, match="NaN or inf"):
        land_requantised(c, _on_device(key), _on_device(value), s, 4, torch.tensor(ids, device=DEVICE))
    _assert_same_cache(_storage(cache_shape, dtype, CPU), s)


def test_bad_arguments_are_refused_by_name_and_write_nothing() -> None:
    from workers.runtime.kernels.kv_requant import land_requantised

    cache_shape = (6, 4, 2, 8)
    k, v = _kv(cache_shape, 2, 4)
    c = get_codec("int4")
    key, value = _on_device(c.encode(k, Kind.KEY)), _on_device(c.encode(v, Kind.VALUE))
    s = _storage(cache_shape, "int8", DEVICE)
    ids = torch.tensor([1, 4], dtype=torch.long, device=DEVICE)
    with pytest.raises(CodecError, match="block ids must be a 1-D long tensor"):
        land_requantised(c, key, value, s, 4, ids.to(torch.int32))
    with pytest.raises(CodecError, match=r"expected KEY of \(3, 4, 2, 8\)"):
        land_requantised(c, key, value, s, 4, torch.tensor([1, 4, 5], device=DEVICE))
    with pytest.raises(CodecError, match="expected KEY"):
        land_requantised(c, value, key, s, 4, ids)
    with pytest.raises(CodecError, match="cannot decode codec id"):
        land_requantised(get_codec("int8"), key, value, s, 4, ids)
    with pytest.raises(CodecError, match="is not blocks of 5 tokens"):
        land_requantised(c, key, value, s, 5, ids)
    dense = DenseLayerStorage(_spec(cache_shape), 6, "float32", DEVICE)
    with pytest.raises(CodecError, match="writes a quantised"):
        land_requantised(c, key, value, dense, 4, ids)  # type: ignore[arg-type]  # the refusal under test
    _assert_same_cache(_storage(cache_shape, "int8", CPU), s)
