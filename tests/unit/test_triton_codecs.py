"""The fused Triton codec kernels (kvtransfer.codecs.fused) against the torch codecs, byte for byte.

Without CUDA the kernels run on CPU through Triton's interpreter (tests.unit.triton_env); with CUDA
the same tests run the compiled kernels. Sizes stay tiny: the interpreter runs each program in Python.
"""

from __future__ import annotations

from typing import Literal

import pytest
import torch

from kvtransfer.codecs import CodecError, Kind, get_codec
from kvtransfer.codecs.fused import decode_blocks, encode_blocks
from tests.unit.triton_env import DEVICE

pytestmark = pytest.mark.unit

# (num_blocks in the cache, block_size, kv_heads, head_dim): odd sizes exercise the masks, 3 heads a
# head count that is not a power of two, block 64 the token loops and int4's two key groups per block.
SHAPES = [(6, 4, 2, 8), (4, 2, 3, 64), (2, 64, 1, 4), (5, 3, 1, 6)]
IDS = [2, 0, 3]  # out of order, with gaps: blocks are addressed by index
CODECS = ["int8", "fp8", "int4", "bf16", "fp32"]


def _cache(shape: tuple[int, int, int, int], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random blocks at very different magnitudes (tiny, normal, large), so scales differ per block."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen)
    mags = torch.tensor([1e-3, 1.0, 300.0, 2.0**-30, 7.0, 1e4])[: shape[0]].view(-1, 1, 1, 1)
    return (x * mags).to(dtype).to(DEVICE)


def _ids(n_blocks: int) -> torch.Tensor:
    return torch.tensor([i for i in IDS if i < n_blocks], dtype=torch.long, device=DEVICE)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8).cpu()


def _assert_same_bytes(codec: str, cache: torch.Tensor, ids: torch.Tensor, kind: Kind) -> None:
    c = get_codec(codec)
    ref = c.encode(cache.index_select(0, ids).cpu(), kind)  # the torch codec on CPU: the reference
    payload = torch.empty(ref.payload.numel(), dtype=torch.uint8, device=DEVICE)
    enc = encode_blocks(c, cache, ids, kind, payload)
    assert enc.payload.device == cache.device and enc.scales.device == cache.device
    assert torch.equal(_bits(enc.payload), ref.payload)
    assert torch.equal(_bits(enc.scales), _bits(ref.scales))
    assert (enc.zeros is None) == (ref.zeros is None)
    if ref.zeros is not None and enc.zeros is not None:
        assert torch.equal(_bits(enc.zeros), _bits(ref.zeros))
    # decode straight into those blocks of a cache; the other blocks stay untouched
    for out_dtype in (torch.float32, torch.bfloat16):
        dest = torch.full(cache.shape, 5.0, dtype=out_dtype, device=DEVICE)
        decode_blocks(c, enc, dest, ids)
        want = c.decode(ref, out_dtype)
        assert torch.equal(_bits(dest.index_select(0, ids)), _bits(want)), (codec, kind, out_dtype)
        others = [b for b in range(cache.shape[0]) if b not in ids.tolist()]
        assert bool((dest[others] == 5.0).all())


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_bytes_equal_the_torch_codec(codec: str, shape: tuple[int, int, int, int]) -> None:
    for dtype, kind, seed in ((torch.float32, Kind.KEY, 1), (torch.bfloat16, Kind.VALUE, 2)):
        _assert_same_bytes(codec, _cache(shape, dtype, seed), _ids(shape[0]), kind)


@pytest.mark.parametrize("codec", CODECS)
def test_signed_zeros_keep_their_sign_as_the_torch_codec_does(codec: str) -> None:
    """-0.0 and +0.0 side by side, in blocks whose other values set the scales: encoded and decoded bits
    equal the torch codec's (a negation lowered to 0 - x, as triton 3.6 does, turns a decoded -0 into +0)."""
    for dtype, kind, seed in ((torch.float32, Kind.KEY, 3), (torch.bfloat16, Kind.VALUE, 4)):
        cache = _cache((4, 4, 2, 8), torch.float32, seed).cpu()
        cache[..., 0::3] = -0.0
        cache[..., 1::3] = 0.0
        _assert_same_bytes(codec, cache.to(dtype).to(DEVICE), _ids(4), kind)


def test_round_half_to_even_and_subnormals() -> None:
    """Exact ties for int8 (scale 1), fp8 midpoints between neighbouring codes and fp8 subnormals."""
    int8_block = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5] * 4).view(1, 4, 1, 8)
    codes = torch.arange(0, 126, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    mids = (codes[:-1] + codes[1:]) / 2  # exactly between two codes: ties to the even one
    fp8_vals = torch.cat([torch.tensor([448.0]), codes, -mids, 2.0**-9 * torch.arange(0, 7) + 2.0**-11])
    fp8_block = torch.zeros(64)
    fp8_block[: min(64, fp8_vals.numel())] = fp8_vals[:64]
    fp8_block2 = torch.zeros(64)
    rest = fp8_vals[64:128]
    fp8_block2[: rest.numel()] = rest
    fp8_block2[-1] = 448.0
    cases = [("int8", int8_block), ("fp8", torch.stack([fp8_block, fp8_block2]).view(2, 4, 2, 8))]
    for codec, x in cases:
        x = x.to(DEVICE)
        _assert_same_bytes(codec, x, torch.arange(x.shape[0], device=DEVICE), Kind.KEY)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_input_is_refused_like_the_torch_codec(codec: str, bad: float) -> None:
    cache = _cache((4, 4, 2, 8), torch.float32, 5)
    cache[3, 1, 1, 5] = bad
    c = get_codec(codec)
    ids = torch.tensor([1, 3], dtype=torch.long, device=DEVICE)
    with pytest.raises(CodecError) as ref:
        c.encode(cache.index_select(0, ids).cpu(), Kind.VALUE)
    payload = torch.empty(c.payload_nbytes((2, 4, 2, 8), Kind.VALUE), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(CodecError) as got:
        encode_blocks(c, cache, ids, Kind.VALUE, payload)
    assert str(got.value) == str(ref.value)
    # the same blocks without the bad one encode fine
    encode_blocks(c, cache, torch.tensor([0, 1], dtype=torch.long, device=DEVICE), Kind.VALUE, payload)


@pytest.mark.parametrize("codec", CODECS)
def test_unchecked_encode_defers_the_refusal_to_host_copies(codec: str) -> None:
    """The layer hook's launch-only encode: no refusal at launch; ``refuse`` on host copies of the scales
    and flags raises what the torch codec raises."""
    from kvtransfer.codecs.fused import encode_blocks_unchecked, refuse

    cache = _cache((3, 4, 2, 8), torch.float32, 6)
    cache[2, 0, 0, 0] = float("nan")
    c = get_codec(codec)
    payload = torch.empty(c.payload_nbytes((2, 4, 2, 8), Kind.KEY), dtype=torch.uint8, device=DEVICE)
    enc, flags = encode_blocks_unchecked(c, cache, torch.tensor([0, 2], device=DEVICE), Kind.KEY, payload)
    with pytest.raises(CodecError, match="NaN or inf"):
        refuse(c, enc.scales.cpu(), None if flags is None else flags.cpu())
    enc, flags = encode_blocks_unchecked(c, cache, torch.tensor([0, 1], device=DEVICE), Kind.KEY, payload)
    refuse(c, enc.scales.cpu(), None if flags is None else flags.cpu())  # finite blocks pass


def test_float32_overflow_to_bf16_is_refused() -> None:
    cache = torch.zeros(2, 2, 1, 4, device=DEVICE)
    cache[1, 0, 0, 0] = 3.4e38  # finite in float32, inf once rounded to bf16
    c = get_codec("bf16")
    payload = torch.empty(c.payload_nbytes((2, 2, 1, 4), Kind.KEY), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(CodecError, match="NaN or inf"):
        encode_blocks(c, cache, torch.arange(2, device=DEVICE), Kind.KEY, payload)


@pytest.mark.parametrize("lo, hi, message", [(-7e4, 0.0, "minimum is beyond float16"),
                                             (-6e4, 1e6, r"range / 15 is beyond float16")])
def test_int4_range_refusals_match(lo: float, hi: float, message: str) -> None:
    cache = torch.zeros(1, 4, 1, 8, device=DEVICE)
    cache[0, 0, 0, 0], cache[0, 1, 0, 0] = lo, hi  # one key channel's token group spans [lo, hi]
    c = get_codec("int4")
    with pytest.raises(CodecError, match=message):
        c.encode(cache.cpu(), Kind.KEY)
    payload = torch.empty(c.payload_nbytes((1, 4, 1, 8), Kind.KEY), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(CodecError, match=message):
        encode_blocks(c, cache, torch.arange(1, device=DEVICE), Kind.KEY, payload)


def test_bad_arguments_are_refused_by_name() -> None:
    c = get_codec("int8")
    cache = torch.zeros(2, 4, 1, 8, device=DEVICE)
    payload = torch.empty(c.payload_nbytes((1, 4, 1, 8), Kind.KEY), dtype=torch.uint8, device=DEVICE)
    with pytest.raises(CodecError, match="block ids must be a 1-D long tensor"):
        encode_blocks(c, cache, torch.tensor([0], dtype=torch.int32, device=DEVICE), Kind.KEY, payload)
    with pytest.raises(CodecError, match="payload must be 64 uint8 bytes"):
        encode_blocks(c, cache, torch.tensor([0, 1], device=DEVICE), Kind.KEY, payload)
    with pytest.raises(CodecError, match="cache must be float32/bf16"):
        encode_blocks(c, cache.half(), torch.tensor([0], device=DEVICE), Kind.KEY, payload)


def test_the_registry_builds_each_fused_codec_with_the_kernels():
    """Codec.encode/decode_into reach the fused kernels only through what the registry built the codec
    with (base.py does not import fused): every codec fused covers gets it, the others none."""
    from kvtransfer.codecs import available_codecs, fused, get_codec

    for name in available_codecs():
        assert (get_codec(name)._kernels is fused) == (name in fused.FUSED_CODECS), name


def test_fp32_moves_the_bits_from_strided_blocks_and_rounds_only_into_bf16():
    """fp32 is a raw copy: -0.0, subnormals and the largest float32 keep their bits, read from a cache
    that is a strided view (every other head of a wider tensor); decoding into a bf16 cache rounds half
    to even as torch's cast does (ties both ways), into a float32 one it changes nothing."""
    wide = _cache((4, 4, 4, 8), torch.float32, 9)
    cache = wide[:, :, ::2]  # [4, 4, 2, 8], not contiguous
    special = torch.tensor([-0.0, 2.0**-149, -(2.0**-140), 3.4028234663852886e38,
                            1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 2.0**-126])
    cache[1, 2, 1] = special.to(DEVICE)
    assert not cache.is_contiguous()
    ids = torch.tensor([3, 1], dtype=torch.long, device=DEVICE)
    _assert_same_bytes("fp32", cache, ids, Kind.VALUE)
    c = get_codec("fp32")
    payload = torch.empty(c.payload_nbytes((2, 4, 2, 8), Kind.KEY), dtype=torch.uint8, device=DEVICE)
    enc = encode_blocks(c, cache, ids, Kind.KEY, payload)
    assert torch.equal(_bits(enc.payload.view(torch.float32).view(2, 4, 2, 8)[1, 2, 1]), _bits(special))
    for dtype in (torch.float32, torch.bfloat16):
        dest = torch.zeros((5, 4, 4, 8), dtype=dtype, device=DEVICE)[:, :, 1::2]  # strided destination
        decode_blocks(c, enc, dest, ids)
        assert torch.equal(_bits(dest[1, 2, 1]), _bits(special.to(dtype))), dtype


def _quantised(shape: tuple[int, int, int, int], qdtype: torch.dtype, dtype: torch.dtype, seed: int):
    """A quantised cache layer as the engine stores one: codes and a float32 scale per (token, head)."""
    from kvtransfer.codecs.paged import QuantizedBlocks

    x = _cache(shape, torch.float32, seed).cpu()
    qmax = 127.0 if qdtype == torch.int8 else 448.0
    scales = x.abs().amax(-1).clamp_min(1e-12) / qmax
    q = x / scales[..., None]
    codes = q.round().clamp(-qmax, qmax).to(qdtype) if qdtype == torch.int8 else q.to(qdtype)
    return QuantizedBlocks(codes.to(DEVICE), scales.to(DEVICE), dtype)


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("qdtype", [torch.int8, torch.float8_e4m3fn], ids=["int8-cache", "fp8-cache"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_encode_straight_from_a_quantised_cache(codec: str, qdtype: torch.dtype, dtype: torch.dtype):
    """Every encode kernel dequantises as it reads (code * scale, rounded to the engine's dtype) and writes
    the bytes the torch codec writes for the gathered blocks (QuantizedBlocks.gather: the engine's gather)."""
    c = get_codec(codec)
    for shape, kind, seed in (((5, 4, 3, 8), Kind.KEY, 11), ((4, 2, 3, 64), Kind.VALUE, 12)):
        src = _quantised(shape, qdtype, dtype, seed)
        ids = _ids(shape[0])
        ref = c.encode(src.gather(ids).cpu(), kind)
        payload = torch.empty(ref.payload.numel(), dtype=torch.uint8, device=DEVICE)
        enc = encode_blocks(c, src, ids, kind, payload)
        assert torch.equal(_bits(enc.payload), ref.payload), (shape, kind)
        assert torch.equal(_bits(enc.scales), _bits(ref.scales)), (shape, kind)
        if ref.zeros is not None and enc.zeros is not None:
            assert torch.equal(_bits(enc.zeros), _bits(ref.zeros)), (shape, kind)


def test_a_quantised_cache_read_through_strides_and_its_refusals():
    """A strided quantised cache (every other head) encodes the same bytes; a NaN fp8 code or an inf scale
    is refused with the torch codec's message, by every codec."""
    from kvtransfer.codecs.paged import QuantizedBlocks

    wide = _quantised((4, 4, 4, 8), torch.float8_e4m3fn, torch.bfloat16, 13)
    src = QuantizedBlocks(wide.data[:, :, ::2], wide.scales[:, :, ::2], torch.bfloat16)
    ids = torch.tensor([3, 1], dtype=torch.long, device=DEVICE)
    c = get_codec("fp8")
    ref = c.encode(src.gather(ids).cpu(), Kind.KEY)
    payload = torch.empty(ref.payload.numel(), dtype=torch.uint8, device=DEVICE)
    assert torch.equal(_bits(encode_blocks(c, src, ids, Kind.KEY, payload).payload), ref.payload)
    for poison in ("code", "scale"):
        bad = QuantizedBlocks(src.data.clone(), src.scales.clone(), torch.bfloat16)
        if poison == "code":
            bad.data.view(torch.uint8)[1, 2, 0, 3] = 0x7F  # e4m3fn NaN
        else:
            bad.scales[1, 0, 1] = float("inf")
        for codec in CODECS:
            with pytest.raises(CodecError) as want:
                get_codec(codec).encode(bad.gather(ids).cpu(), Kind.VALUE)
            out = torch.empty(get_codec(codec).payload_nbytes((2, 4, 2, 8), Kind.VALUE), dtype=torch.uint8,
                              device=DEVICE)
            with pytest.raises(CodecError) as got:
                encode_blocks(get_codec(codec), bad, ids, Kind.VALUE, out)
            assert str(got.value) == str(want.value) and "NaN or inf" in str(got.value)
    with pytest.raises(CodecError, match="scales must be float32"):
        QuantizedBlocks(src.data, src.scales.double(), torch.float32)


@pytest.mark.parametrize("name", ["int8", "fp8"])
def test_quantised_blocks_gather_is_the_engines_gather(name: Literal["int8", "fp8"]):
    """QuantizedBlocks.gather (the reference the kernels match) equals QuantizedLayerStorage.gather bit for
    bit, so a layer sent from the cache carries what the gathered snapshot carried."""
    from kvtransfer.codecs.paged import QuantizedBlocks
    from workers.runtime.kv_cache import KVCacheSpec, QuantizedLayerStorage, block_slots

    bs, h, d = 4, 2, 8
    spec = KVCacheSpec(num_layers=1, num_kv_heads=h, head_dim=d, block_size=bs)
    storage = QuantizedLayerStorage(spec, 6, name, torch.device("cpu"))
    gen = torch.Generator().manual_seed(3)
    storage.write(torch.arange(24), torch.randn(24, h, d, generator=gen) * 9, torch.randn(24, h, d, generator=gen))
    ids = torch.tensor([4, 1, 5])
    for dtype in (torch.float32, torch.bfloat16):
        want_k, want_v = storage.gather(block_slots(ids.tolist(), bs, torch.device("cpu")), dtype)
        for data, scale, want in ((storage.k, storage.k_scale, want_k), (storage.v, storage.v_scale, want_v)):
            got = QuantizedBlocks(data.view(-1, bs, h, d), scale.view(-1, bs, h), dtype).gather(ids)
            assert got.dtype == dtype and torch.equal(_bits(got), _bits(want.view(3, bs, h, d)))
