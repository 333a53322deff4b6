"""``CacheSink``: received KV blocks landing in the decode cache, for each storage the decode worker can
keep (dequantised into a float cache, or ``native``: int8/fp8 kept as received)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer.codecs import CodecError, Kind, get_codec
from kvtransfer.cuda_ipc import DeviceParts
from kvtransfer.receiver import WireParts
from workers.decode.kv_sink import CacheSink, decode_cache_dtypes
from workers.runtime.kv_cache import CacheDType, KVCacheSpec, PagedKVCache

pytestmark = pytest.mark.unit

SPEC = KVCacheSpec(num_layers=2, num_kv_heads=4, head_dim=32, block_size=16)
BLOCKS = [5, 6, 2, 9, 10]  # two runs of consecutive ids and a lone block, out of order


def _wire(codec: str, x: torch.Tensor, kind: Kind) -> tuple[WireParts, torch.Tensor]:
    enc = get_codec(codec).encode(x, kind)
    scales = memoryview(enc.scales.contiguous().view(torch.uint8).numpy().tobytes())
    parts = WireParts(memoryview(enc.payload.numpy().tobytes()), scales, None)
    return parts, get_codec(codec).decode(enc, torch.float32)


def _kv(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (len(BLOCKS), SPEC.block_size, SPEC.num_kv_heads, SPEC.head_dim)
    # heads on very different scales, so a scale landing on the wrong head or block shows
    ramp = torch.tensor([0.01, 1.0, 30.0, 0.5]).view(1, 1, 4, 1)
    return torch.randn(*shape, generator=g) * ramp, torch.randn(*shape, generator=g) * ramp


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_native_storage_holds_exactly_what_the_codec_decodes(codec: CacheDType) -> None:
    assert decode_cache_dtypes((codec, "bf16"), "float32", "native") == (codec, "float32")
    cache = PagedKVCache(SPEC, 16, (codec, "float32"))
    sink = CacheSink(cache)
    k, v = _kv(1)
    (kw, k_want), (vw, v_want) = _wire(codec, k, Kind.KEY), _wire(codec, v, Kind.VALUE)
    sink.write(0, BLOCKS, codec, tuple(k.shape), kw, vw)  # type: ignore[arg-type]  # a 4-d shape

    tokens = len(BLOCKS) * SPEC.block_size
    got_k, got_v = cache.read_tokens(0, BLOCKS, tokens, torch.float32)
    assert torch.equal(got_k, k_want.reshape(tokens, 4, 32))  # bit for bit: the same q x scale products
    assert torch.equal(got_v, v_want.reshape(tokens, 4, 32))
    untouched = [b for b in range(16) if b not in BLOCKS]
    k_rest, v_rest = cache.read_tokens(0, untouched, len(untouched) * SPEC.block_size, torch.float32)
    assert not k_rest.any() and not v_rest.any(), "wrote outside the request's blocks"


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_native_storage_refuses_a_short_part_and_writes_nothing(codec: CacheDType) -> None:
    cache = PagedKVCache(SPEC, 16, (codec, "float32"))
    sink = CacheSink(cache)
    k, v = _kv(2)
    (kw, _), (vw, _) = _wire(codec, k, Kind.KEY), _wire(codec, v, Kind.VALUE)
    short_payload = WireParts(kw.payload[:-1], kw.scales, None)
    short_scales = WireParts(kw.payload, kw.scales[:-4], None)
    for bad, words in ((short_payload, "payload"), (short_scales, "scales")):
        with pytest.raises(CodecError, match=words):
            sink.write(0, BLOCKS, codec, tuple(k.shape), bad, vw)  # type: ignore[arg-type]  # a 4-d shape
    got_k, got_v = cache.read_tokens(0, list(range(16)), 16 * SPEC.block_size, torch.float32)
    assert not got_k.any() and not got_v.any()


def test_native_and_dequantized_storage_agree_within_the_float_rounding() -> None:
    native = PagedKVCache(SPEC, 16, ("int8", "float32"))
    dense = PagedKVCache(SPEC, 16, ("float32", "float32"))
    k, v = _kv(3)
    (kw, _), (vw, _) = _wire("int8", k, Kind.KEY), _wire("int8", v, Kind.VALUE)
    for cache in (native, dense):
        CacheSink(cache).write(0, BLOCKS, "int8", tuple(k.shape), kw, vw)  # type: ignore[arg-type]  # a 4-d shape
    tokens = len(BLOCKS) * SPEC.block_size
    for a, b in zip(native.read_tokens(0, BLOCKS, tokens, torch.float32), dense.read_tokens(0, BLOCKS, tokens,
                                                                                             torch.float32)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("codec", ["int8", "fp8"])
@pytest.mark.parametrize("layer_dtype,read_dtype,limit", [
    ("bfloat16", torch.float32, 3.38e38), ("float32", torch.float32, 3.4e38), (None, torch.float32, 3.4e38),
    ("float32", torch.bfloat16, 3.38e38), (None, torch.bfloat16, 3.38e38)])
def test_scales_that_decode_past_the_layers_range_are_refused_and_write_nothing(
        codec: CacheDType, layer_dtype: CacheDType | None, read_dtype: torch.dtype, limit: float) -> None:
    """Finite scales can still decode to inf where they land (the float layer's dtype) or where they are read
    (the model's dtype, a native layer's codes and scales included). Values inside the range land; ones past
    it are refused before anything is written."""
    dtype = layer_dtype or codec  # None: the codec's own native layer
    cache = PagedKVCache(SPEC, 16, (dtype, "float32"), read_dtype=read_dtype)
    sink = CacheSink(cache)
    max_code = get_codec(codec).max_code
    inside, past = _kv(3)
    inside = inside / inside.abs().amax() * limit * 0.4  # scale = 0.4 * limit / max_code: inside
    (kw, _), (vw, _) = _wire(codec, inside, Kind.KEY), _wire(codec, inside, Kind.VALUE)
    sink.write(0, BLOCKS, codec, tuple(inside.shape), kw, vw)  # type: ignore[arg-type]  # a 4-d shape
    got_k, _ = cache.read_tokens(0, BLOCKS, len(BLOCKS) * SPEC.block_size, read_dtype)
    assert torch.isfinite(got_k).all()
    scales = torch.frombuffer(bytearray(kw.scales), dtype=torch.float32)
    beyond = 3.395e38 if limit < 3.39e38 else limit * 1.01  # bf16: between its largest (3.39e38) and float32's
    scales[3] = beyond / max_code  # a code of max_code decodes past the limit
    bad = WireParts(kw.payload, memoryview(scales.numpy().tobytes()), None)
    with pytest.raises(ValueError, match=r"the keys' scales decode to magnitudes up to .*, past"):
        sink.write(0, [0, 1, 3, 4, 7], codec, tuple(inside.shape), bad, vw)  # type: ignore[arg-type]
    k_rest, v_rest = cache.read_tokens(0, [0, 1, 3, 4, 7], 5 * SPEC.block_size, torch.float32)
    assert not k_rest.any() and not v_rest.any()


def test_an_int4_groups_reach_is_its_own_zero_point_plus_its_range_not_the_largest_of_each() -> None:
    """int4 decodes code * scale + zero with codes 0..15: a group from -40000 to 0 reaches 40000, not
    15 * scale + |zero| (80000), and groups do not mix their scales and zero points."""
    from workers.decode.kv_sink import _reach

    scales = np.array([40000 / 15, 1.0], dtype=np.float16)
    zeros = np.array([-40000.0, 60000.0], dtype=np.float16)
    part = WireParts(memoryview(b""), memoryview(scales.tobytes()), memoryview(zeros.tobytes()))
    want = max(abs(float(zeros[0])), abs(float(zeros[0]) + 15 * float(scales[0])), 60000.0 + 15)
    assert _reach(part, torch.float16, 15.0) == pytest.approx(want)
    # the device path computes the same from tensors (uint8 bytes, as a CUDA IPC segment's slices are)
    tensors = DeviceParts(torch.empty(0, dtype=torch.uint8), torch.from_numpy(scales.view(np.uint8).copy()),
                          torch.from_numpy(zeros.view(np.uint8).copy()))
    assert float(_reach(tensors, torch.float16, 15.0)) == pytest.approx(want)
