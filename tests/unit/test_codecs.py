"""KV codecs: round trips within the stated bounds, wire layouts, receiving, refusals."""

from __future__ import annotations

import dataclasses
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtransfer.codecs import (
    CodecError,
    CodecId,
    EncodedTensor,
    Kind,
    available_codecs,
    from_buffer,
    get_codec,
    get_codec_by_id,
)

pytestmark = [pytest.mark.unit]

ALL = ("bf16", "fp8", "int8", "int4", "fp32")
LOSSY = ("fp8", "int8", "int4")
KINDS = (Kind.KEY, Kind.VALUE)
DTYPES = (torch.float32, torch.bfloat16)
PATTERNS = ("normal", "zeros", "constant", "large", "tiny", "offset", "mixed")
FAST = settings(max_examples=50, deadline=None)


def make_kv(shape: tuple[int, int, int, int], pattern: str, dtype: torch.dtype, seed: int) -> torch.Tensor:
    """A KV-like tensor; 'mixed' gives every block its own magnitude, zero and constant blocks included."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    n = shape[0]
    if pattern == "zeros":
        x.zero_()
    elif pattern == "constant":
        x.fill_(float(torch.randn((), generator=g)) * 10)
    elif pattern == "large":
        x.mul_(1e4)
    elif pattern == "tiny":
        x.mul_(1e-6)
    elif pattern == "offset":  # small spread around a large mean: stresses int4's zero points
        x.mul_(1e-2).add_(1e3)
    elif pattern == "mixed":
        mags = 10.0 ** (torch.rand(n, generator=g) * 10 - 6)
        x.mul_(mags.view(n, 1, 1, 1))
        x[0].zero_()
        if n > 1:
            x[1].fill_(-3.5)
    return x.to(dtype)


@st.composite
def kv_tensors(draw: st.DrawFn) -> torch.Tensor:
    shape = (
        draw(st.integers(1, 4)),
        draw(st.sampled_from([8, 16, 32])),
        draw(st.integers(1, 4)),
        draw(st.sampled_from([32, 64, 128])),
    )
    return make_kv(
        shape,
        draw(st.sampled_from(PATTERNS)),
        draw(st.sampled_from(DTYPES)),
        draw(st.integers(0, 2**31 - 1)),
    )


def bits(t: torch.Tensor) -> torch.Tensor:
    """Raw bit patterns, so equality is bit equality (signed zeros included)."""
    return t.view(torch.int16) if t.dtype == torch.bfloat16 else t.view(torch.int32)


# -- round trips ---------------------------------------------------------------------------


@FAST
@given(x=kv_tensors(), kind=st.sampled_from(KINDS))
def test_bf16_is_bit_exact_for_bf16_input(x: torch.Tensor, kind: Kind) -> None:
    x = x.to(torch.bfloat16)
    codec = get_codec("bf16")
    enc = codec.encode(x, kind)
    assert torch.equal(bits(codec.decode(enc, torch.bfloat16)), bits(x))
    assert torch.equal(bits(codec.decode(enc, torch.float32).to(torch.bfloat16)), bits(x))
    assert (codec.max_abs_error_bound(x, kind, torch.bfloat16) == 0).all()


@FAST
@given(x=kv_tensors(), kind=st.sampled_from(KINDS))
def test_bf16_of_float32_input_is_the_bf16_rounding(x: torch.Tensor, kind: Kind) -> None:
    x = x.to(torch.float32)
    codec = get_codec("bf16")
    y = codec.decode(codec.encode(x, kind), torch.float32)
    assert torch.equal(y, x.to(torch.bfloat16).to(torch.float32))
    assert ((y - x).abs() <= codec.max_abs_error_bound(x, kind)).all()


@FAST
@given(
    x=kv_tensors(),
    name=st.sampled_from(LOSSY),
    kind=st.sampled_from(KINDS),
    out_dtype=st.sampled_from(DTYPES),
)
def test_lossy_codecs_stay_within_their_bound(
    x: torch.Tensor, name: str, kind: Kind, out_dtype: torch.dtype
) -> None:
    codec = get_codec(name)
    enc = codec.encode(x, kind)
    layout = codec.layout(x.shape, kind)
    assert enc.payload.nbytes == layout.payload_nbytes == codec.payload_nbytes(x.shape, kind)
    assert enc.scales.nbytes == layout.scale_nbytes == codec.scale_nbytes(x.shape, kind)
    assert (0 if enc.zeros is None else enc.zeros.nbytes) == codec.zero_nbytes(x.shape, kind)
    assert enc.nbytes == layout.total_nbytes
    y = codec.decode(enc, out_dtype)
    assert y.dtype == out_dtype and tuple(y.shape) == tuple(x.shape)
    err = (y.float() - x.float()).abs()
    bound = codec.max_abs_error_bound(x, kind, out_dtype).expand_as(err)
    worst = int((err - bound).argmax())
    assert (err <= bound).all(), (
        f"{name}/{kind}: err {err.flatten()[worst].item():.3g} > bound {bound.flatten()[worst].item():.3g}"
        f" at x={x.flatten()[worst].item():.6g}"
    )


@pytest.mark.parametrize("name", LOSSY)
def test_zero_blocks_decode_to_exact_zeros(name: str) -> None:
    x = torch.zeros(2, 16, 2, 64, dtype=torch.bfloat16)
    for kind in KINDS:
        assert torch.equal(get_codec(name).decode(get_codec(name).encode(x, kind), torch.float32), x.float())


@pytest.mark.parametrize("name", LOSSY)
def test_bound_is_tight_enough_to_mean_something(name: str) -> None:
    # Gaussian data: the error stays under ~2.5% of the block's range and the bound under ~7%.
    x = make_kv((8, 16, 4, 128), "normal", torch.float32, seed=1)
    codec = get_codec(name)
    for kind in KINDS:
        err = (codec.decode(codec.encode(x, kind), torch.float32) - x).abs().max().item()
        bound = codec.max_abs_error_bound(x, kind).max().item()
        amax = x.abs().max().item()
        assert err <= bound <= 0.07 * 2 * amax


def test_codecs_order_by_accuracy_on_gaussian_data() -> None:
    x = make_kv((8, 16, 4, 128), "normal", torch.float32, seed=2)
    rms = {}
    for name in ALL:
        y = get_codec(name).decode(get_codec(name).encode(x, Kind.KEY), torch.float32)
        rms[name] = (y - x).pow(2).mean().sqrt().item()
    assert rms["bf16"] < rms["int8"] < rms["fp8"] < rms["int4"]


@pytest.mark.parametrize("name", ALL)
def test_decode_into_a_strided_cache_view_writes_only_there(name: str) -> None:
    x = make_kv((3, 16, 2, 64), "normal", torch.bfloat16, seed=3)
    codec = get_codec(name)
    enc = codec.encode(x, Kind.VALUE)
    for dtype in DTYPES:
        cache = torch.full((7, 16, 2, 64), 9.0, dtype=dtype)
        dst = cache[1:7:2]  # three reserved blocks, not contiguous
        assert not dst.is_contiguous()
        assert codec.decode_into(enc, dst) is dst
        assert torch.equal(bits(dst.contiguous()), bits(codec.decode(enc, dtype)))
        untouched = cache[0:7:2]
        assert (untouched == 9.0).all()


def test_decode_into_spans_several_chunks() -> None:
    # More blocks than one kernel call takes: the chunked loop must cover them all, in order.
    x = make_kv((300, 16, 2, 64), "mixed", torch.float32, seed=4)
    for name in ALL:
        codec = get_codec(name)
        for kind in KINDS:
            out = torch.empty(x.shape, dtype=torch.float32)
            codec.decode_into(codec.encode(x, kind), out)
            assert ((out - x).abs() <= codec.max_abs_error_bound(x, kind)).all(), (name, kind)


def test_encode_leaves_its_input_alone() -> None:
    x = make_kv((2, 16, 2, 64), "normal", torch.float32, seed=5)
    before = x.clone()
    for name in ALL:
        get_codec(name).encode(x, Kind.KEY)
        assert torch.equal(x, before)


def test_bf16_payload_aliases_a_bf16_input() -> None:
    x = make_kv((2, 16, 2, 64), "normal", torch.bfloat16, seed=6)
    enc = get_codec("bf16").encode(x, Kind.KEY)
    assert enc.payload.data_ptr() == x.data_ptr()


# -- layouts -------------------------------------------------------------------------------


def test_layouts_for_a_typical_block() -> None:
    shape = (4, 16, 8, 128)
    numel = 4 * 16 * 8 * 128
    assert get_codec("bf16").layout(shape, Kind.KEY).total_nbytes == 2 * numel
    fp8 = get_codec("fp8").layout(shape, Kind.KEY)
    assert (fp8.payload_nbytes, fp8.scales_shape, fp8.scales_dtype) == (numel, (4,), torch.float32)
    int8 = get_codec("int8").layout(shape, Kind.VALUE)
    assert (int8.payload_nbytes, int8.scales_shape) == (numel, (4, 8))
    k4 = get_codec("int4").layout(shape, Kind.KEY)
    assert (k4.payload_nbytes, k4.scales_shape, k4.zeros_shape) == (numel // 2, (4, 1, 8, 128), (4, 1, 8, 128))
    assert k4.scales_dtype == torch.float16
    v4 = get_codec("int4").layout(shape, Kind.VALUE)
    assert (v4.scales_shape, v4.zero_nbytes) == ((4, 16, 8, 4), 4 * 16 * 8 * 4 * 2)
    # block_size 64: two key groups of 32 tokens per block.
    assert get_codec("int4").layout((1, 64, 1, 32), "key").scales_shape == (1, 2, 1, 32)


@pytest.mark.parametrize(
    ("name", "shape", "fragment"),
    [
        ("int8", (16, 2, 64), "shape must be"),
        ("fp8", (1, 0, 2, 64), "shape must be"),
        ("int4", (1, 48, 2, 64), "block_size"),
        ("int4", (1, 16, 2, 48), "head_dim"),
        ("int4", (1, 16, 2, 7), "even"),
    ],
)
def test_unsupported_shapes_are_refused(name: str, shape: tuple[int, ...], fragment: str) -> None:
    with pytest.raises(CodecError, match=fragment):
        get_codec(name).layout(shape, Kind.KEY)


@pytest.mark.parametrize("dtype", [torch.float16, torch.int8, torch.float64])
def test_unsupported_input_dtypes_are_refused(dtype: torch.dtype) -> None:
    with pytest.raises(CodecError, match="float32 or bfloat16"):
        get_codec("int8").encode(torch.zeros(1, 16, 1, 32, dtype=dtype), Kind.KEY)


def test_unknown_kind_is_refused() -> None:
    with pytest.raises(CodecError, match="unknown kind 'query'"):
        get_codec("int8").encode(torch.zeros(1, 16, 1, 32), "query")


# -- the wire ------------------------------------------------------------------------------


@FAST
@given(x=kv_tensors(), name=st.sampled_from(ALL), kind=st.sampled_from(KINDS), writable=st.booleans())
def test_from_buffer_round_trip(x: torch.Tensor, name: str, kind: Kind, writable: bool) -> None:
    codec = get_codec(name)
    enc = codec.encode(x, kind)
    wrap = bytearray if writable else bytes
    zeros = enc.zeros_view()
    got = from_buffer(
        int(enc.codec_id),
        kind.value,
        tuple(enc.shape),
        wrap(enc.payload_view()),
        wrap(enc.scales_view()),
        None if zeros is None else wrap(zeros),
    )
    assert (got.codec_id, got.kind, got.shape) == (enc.codec_id, enc.kind, enc.shape)
    assert torch.equal(got.payload, enc.payload) and torch.equal(got.scales, enc.scales)
    assert (got.zeros is None) == (enc.zeros is None)
    assert got.zeros is None or (enc.zeros is not None and torch.equal(got.zeros, enc.zeros))
    assert torch.equal(bits(codec.decode(got, torch.float32)), bits(codec.decode(enc, torch.float32)))


def test_views_share_memory_and_writable_buffers_are_not_copied() -> None:
    enc = get_codec("int4").encode(make_kv((2, 16, 2, 64), "normal", torch.bfloat16, 7), Kind.KEY)
    view = enc.payload_view()
    assert len(view) == enc.payload.nbytes and view.format == "B"
    view[0] ^= 0xFF
    assert enc.payload[0].item() == view[0]
    assert enc.zeros is not None
    assert len(enc.scales_view()) == enc.scales.nbytes and len(enc.zeros_view() or b"") == enc.zeros.nbytes
    buf = bytearray(enc.payload_view())
    got = get_codec("int4").from_buffer(Kind.KEY, enc.shape, buf, bytes(enc.scales_view()),
                                        bytes(enc.zeros_view() or b""))
    buf[1] ^= 0xFF
    assert got.payload[1].item() == buf[1]


def _parts(name: str, kind: Kind) -> tuple[EncodedTensor, bytes, bytes, bytes | None]:
    enc = get_codec(name).encode(make_kv((2, 16, 2, 64), "normal", torch.bfloat16, 8), kind)
    z = enc.zeros_view()
    return enc, bytes(enc.payload_view()), bytes(enc.scales_view()), None if z is None else bytes(z)


@pytest.mark.parametrize("name", ALL)
@pytest.mark.parametrize("part", ["payload", "scales", "zeros"])
@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_byte_lengths_are_refused(name: str, part: str, delta: int) -> None:
    enc, payload, scales, zeros = _parts(name, Kind.VALUE)
    parts = {"payload": payload, "scales": scales, "zeros": zeros}
    current = parts[part]
    if current is None or (delta < 0 and not current):
        # A codec without zero points (or scales): extra bytes there are wrong too.
        parts[part] = b"\0" * max(delta, 1)
        fragment = "expected 0"
    else:
        changed = current + b"\0" if delta > 0 else current[:-1]
        parts[part] = changed
        fragment = f"{part} has {len(changed)} bytes, expected"
    with pytest.raises(CodecError, match=fragment):
        from_buffer(enc.codec_id, enc.kind, enc.shape, parts["payload"], parts["scales"], parts["zeros"])


def test_int4_without_zero_points_is_refused() -> None:
    enc, payload, scales, _ = _parts("int4", Kind.KEY)
    with pytest.raises(CodecError, match="needs zero points"):
        from_buffer(CodecId.INT4, Kind.KEY, enc.shape, payload, scales, None)


def test_a_shape_that_does_not_match_the_bytes_is_refused() -> None:
    enc, payload, scales, _ = _parts("int8", Kind.KEY)
    with pytest.raises(CodecError, match="payload has"):
        from_buffer(CodecId.INT8, Kind.KEY, (3, *enc.shape[1:]), payload, scales)


def test_decode_refuses_another_codecs_tensor() -> None:
    enc, *_ = _parts("int8", Kind.KEY)
    with pytest.raises(CodecError, match="cannot decode codec id 3"):
        get_codec("fp8").decode(enc, torch.float32)


def test_decode_into_refuses_a_wrong_destination() -> None:
    enc, *_ = _parts("int8", Kind.KEY)
    with pytest.raises(CodecError, match="destination shape"):
        get_codec("int8").decode_into(enc, torch.empty(1, 16, 2, 64))
    with pytest.raises(CodecError, match="destination dtype"):
        get_codec("int8").decode_into(enc, torch.empty(enc.shape, dtype=torch.float16))


def test_encoded_tensor_is_frozen_and_checked() -> None:
    enc, *_ = _parts("fp8", Kind.KEY)
    with pytest.raises(dataclasses.FrozenInstanceError):
        enc.payload = enc.payload  # type: ignore[misc]  # frozen: the test
    with pytest.raises(CodecError, match="payload must be"):
        dataclasses.replace(enc, payload=enc.payload.view(2, -1))
    with pytest.raises(CodecError, match="scales must be"):
        dataclasses.replace(enc, scales=enc.scales.double())
    as_int = dataclasses.replace(enc, codec_id=2)  # type: ignore[arg-type]  # an int on purpose: it becomes a CodecId
    assert isinstance(as_int.codec_id, CodecId)


# -- registry ------------------------------------------------------------------------------


def test_registry_by_name_and_id() -> None:
    assert available_codecs() == ALL
    assert [int(c) for c in CodecId] == [1, 2, 3, 4, 5]
    for name in ALL:
        codec = get_codec(name)
        assert codec.name == name
        assert get_codec_by_id(codec.codec_id) is codec is get_codec_by_id(int(codec.codec_id))
    assert get_codec("int8").codec_id == CodecId.INT8 == 3


def test_unknown_codecs_are_refused_with_the_known_ones_listed() -> None:
    with pytest.raises(CodecError, match="unknown codec 'int2'; known codecs: bf16, fp8, int8, int4, fp32"):
        get_codec("int2")
    with pytest.raises(CodecError, match=r"unknown codec id 9; known ids: 1 \(bf16\)"):
        get_codec_by_id(9)
    with pytest.raises(CodecError, match="unknown codec id 0"):
        from_buffer(0, Kind.KEY, (1, 16, 1, 32), b"", b"")


# -- refusals at encode --------------------------------------------------------------------


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(ALL),
    kind=st.sampled_from(KINDS),
    dtype=st.sampled_from(DTYPES),
    bad=st.sampled_from([math.nan, math.inf, -math.inf]),
    where=st.integers(0, 2 * 16 * 2 * 64 - 1),
)
def test_non_finite_input_is_refused(name: str, kind: Kind, dtype: torch.dtype, bad: float, where: int) -> None:
    x = make_kv((2, 16, 2, 64), "normal", dtype, seed=where)
    x.view(-1)[where] = bad
    with pytest.raises(CodecError, match="NaN or inf"):
        get_codec(name).encode(x, kind)


def test_float32_beyond_bf16_range_is_refused_by_bf16() -> None:
    x = torch.full((1, 16, 1, 32), torch.finfo(torch.float32).max)
    with pytest.raises(CodecError, match="NaN or inf"):
        get_codec("bf16").encode(x, Kind.KEY)


def test_int4_refuses_values_beyond_float16_scales() -> None:
    x = torch.full((1, 16, 1, 32), -1e5)
    with pytest.raises(CodecError, match="float16"):
        get_codec("int4").encode(x, Kind.KEY)


def test_parts_a_codec_lacks_may_be_none_or_empty() -> None:
    x = make_kv((2, 16, 2, 64), "normal", torch.bfloat16, 9)
    enc = get_codec("bf16").encode(x, Kind.KEY)
    for empty in (None, b""):
        got = from_buffer(CodecId.BF16, Kind.KEY, enc.shape, bytes(enc.payload_view()), empty, empty)
        assert torch.equal(bits(get_codec("bf16").decode(got, torch.bfloat16)), bits(x))


def test_decode_refuses_other_output_dtypes() -> None:
    enc, *_ = _parts("fp8", Kind.KEY)
    with pytest.raises(CodecError, match="out_dtype"):
        get_codec("fp8").decode(enc, torch.float16)


def test_importing_the_package_loads_no_codec_until_asked() -> None:
    code = (
        "import sys, kvtransfer.codecs as c\n"
        "assert not any(m in sys.modules for m in ('kvtransfer.codecs.int4', 'kvtransfer.codecs.fp8'))\n"
        "c.get_codec('int4')\n"
        "assert 'kvtransfer.codecs.int4' in sys.modules and 'kvtransfer.codecs.fp8' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=Path(__file__).resolve().parents[2])


def _wide_range_blocks() -> torch.Tensor:
    """Blocks whose maxima span many binades, so scale quotients hit many rounding cases."""
    x = torch.randn(64, 16, 4, 64, generator=torch.Generator().manual_seed(5))
    return x * torch.logspace(-8, 8, 64).view(64, 1, 1, 1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("name", ["int8", "fp8", "int4"])
def test_torch_codec_on_cuda_writes_the_cpu_s_bytes(name: str) -> None:
    """The eager torch codec (what a GPU without Triton encodes with) gives the same wire bytes on
    CUDA as on the CPU: its scale divisions divide exactly on both devices."""
    c, x = get_codec(name), _wide_range_blocks()
    for kind in (Kind.KEY, Kind.VALUE):
        cpu, gpu = c.encode(x, kind), c.encode(x.cuda(), kind)
        for a, b in ((cpu.payload, gpu.payload), (cpu.scales, gpu.scales), (cpu.zeros, gpu.zeros)):
            assert (a is None) == (b is None)
            if a is not None and b is not None:
                assert torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8).cpu())
