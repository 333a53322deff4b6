"""The KV transfer's fast paths: encode_into, the integer bf16 finite check, the int8 kernel
without its clamp pass, per-thread torch threads and the malloc setting."""

from __future__ import annotations

import threading

import pytest
import torch

from kvtransfer.codecs import CodecError, Kind, available_codecs, get_codec, native
from kvtransfer.codecs.bf16 import all_finite_bf16
from kvtransfer.memory import retain_freed_buffers
from kvtransfer.threads import single_threaded_torch

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("path", ["native", "numpy"])
def test_bf16_finite_check_agrees_with_isfinite_on_every_bit_pattern(path: str,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    if path == "native":
        if native.load() is None:
            pytest.skip("no C compiler: the native kernels are not built here")
    else:
        monkeypatch.setattr(native, "load", lambda: None)
    patterns = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(torch.bfloat16)
    finite = torch.isfinite(patterns)
    base = torch.zeros(64, dtype=torch.bfloat16)
    for i in range(patterns.numel()):
        base[17] = patterns[i]
        assert all_finite_bf16(base) == bool(finite[i]), f"bit pattern {i - 32768:#06x}"
    # a non-contiguous view is checked over its own elements only
    wide = torch.zeros(8, 2, dtype=torch.bfloat16)
    wide[:, 1] = float("nan")
    assert all_finite_bf16(wide[:, 0]) and not all_finite_bf16(wide[:, 1])


@pytest.mark.parametrize("name", available_codecs())
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_encode_into_writes_what_encode_returns(name: str, dtype: torch.dtype) -> None:
    codec = get_codec(name)
    x = torch.randn(5, 16, 4, 32, generator=torch.Generator().manual_seed(3)).to(dtype)
    for kind in Kind:
        want = codec.encode(x, kind)
        out = torch.full((want.payload.numel() + 8,), 0xAB, dtype=torch.uint8)
        got = codec.encode_into(x, kind, out[4:-4])
        assert torch.equal(out[4:-4], want.payload) and torch.equal(got.scales, want.scales)
        assert (got.zeros is None) == (want.zeros is None)
        assert got.zeros is None or (want.zeros is not None and torch.equal(got.zeros, want.zeros))
        assert torch.all(out[:4] == 0xAB) and torch.all(out[-4:] == 0xAB)  # nothing outside the slice


def test_encode_into_refuses_a_destination_of_the_wrong_size() -> None:
    x = torch.randn(2, 16, 4, 32)
    with pytest.raises(CodecError, match="contiguous with 8192 bytes"):
        get_codec("bf16").encode_into(x, Kind.KEY, torch.empty(8191, dtype=torch.uint8))
    with pytest.raises(CodecError, match="1-D uint8"):
        get_codec("int8").encode_into(x, Kind.KEY, torch.empty(4096, dtype=torch.int16))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_encode_into_refuses_non_finite_input_in_any_piece(bad: float) -> None:
    x = torch.randn(80, 16, 8, 128).to(torch.bfloat16)  # 2.5 MiB: several check pieces
    x[79, 15, 7, 127] = bad  # the very last element, in the last piece
    with pytest.raises(CodecError, match="NaN or inf"):
        get_codec("bf16").encode_into(x, Kind.VALUE, torch.empty(x.nbytes, dtype=torch.uint8))


def test_int8_codes_stay_within_127_without_a_clamp() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(64, 16, 8, 64, generator=g) * torch.logspace(-30, 30, 64).view(64, 1, 1, 1)
    x[:, 0] = x.abs().amax(dim=(1, 3), keepdim=True).squeeze(1)  # every (block, head) reaches its amax
    x[:, 1] = -x[:, 0]
    x[0] = 1e-40  # subnormal: the scale floor
    for kind in Kind:
        codes = get_codec("int8").encode(x, kind).payload.view(torch.int8)
        assert int(codes.min()) >= -127 and int(codes.max()) <= 127
        assert int(codes.max()) == 127 and int(codes.min()) == -127


def test_single_threaded_torch_changes_only_the_calling_thread() -> None:
    before = torch.get_num_threads()
    seen: dict[str, int | bool] = {}

    def worker() -> None:
        seen["ok"] = single_threaded_torch()
        seen["inside"] = torch.get_num_threads()

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    if not seen["ok"]:
        pytest.skip("torch here does not use an OpenMP runtime this can reach")
    assert seen["inside"] == 1
    assert torch.get_num_threads() == before
    fresh: list[int] = []
    t = threading.Thread(target=lambda: fresh.append(torch.get_num_threads()))
    t.start()
    t.join()
    assert fresh == [before]  # threads started later keep the process default


def test_retain_freed_buffers_is_applied_once_and_reports_it() -> None:
    first = retain_freed_buffers()
    assert retain_freed_buffers() is first
    assert isinstance(first, bool)


# -- the native int8 kernels ---------------------------------------------------------------------
def _native_or_skip():
    from kvtransfer.codecs import native

    lib = native.load()
    if lib is None:
        pytest.skip("no C compiler here: the int8 codec runs its eager kernels")
    return lib


def _eager_encode(x: torch.Tensor, kind: Kind):
    from kvtransfer.codecs.blockwise import BlockwiseCodec

    codec = get_codec("int8")
    layout = codec.layout(tuple(x.shape), kind)
    assert isinstance(codec, BlockwiseCodec)
    return BlockwiseCodec._encode_into(codec, x, kind, layout, torch.empty(layout.payload_nbytes, dtype=torch.uint8))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_int8_is_bit_identical_to_the_eager_kernels(dtype: torch.dtype) -> None:
    from kvtransfer.codecs.blockwise import BlockwiseCodec

    _native_or_skip()
    codec = get_codec("int8")
    assert isinstance(codec, BlockwiseCodec)
    g = torch.Generator().manual_seed(11)
    x = (torch.randn(40, 16, 8, 128, generator=g) * torch.logspace(-25, 25, 40).view(40, 1, 1, 1)).to(dtype)
    x[0] = 0.0
    x[1] = 1e-40
    for kind in Kind:
        fast, slow = codec.encode(x, kind), _eager_encode(x, kind)
        assert torch.equal(fast.payload, slow.payload) and torch.equal(fast.scales, slow.scales)
        for out_dtype in (torch.float32, torch.bfloat16):
            a, b = torch.empty(x.shape, dtype=out_dtype), torch.empty(x.shape, dtype=out_dtype)
            codec.decode_into(fast, a)
            BlockwiseCodec._decode_into(codec, fast, b)
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_int8_refuses_non_finite_input(bad: float, dtype: torch.dtype) -> None:
    _native_or_skip()
    x = torch.randn(3, 16, 2, 64).to(dtype)
    x[2, 15, 1, 63] = bad
    with pytest.raises(CodecError, match="NaN or inf"):
        get_codec("int8").encode(x, Kind.KEY)


def test_decode_buffer_into_reads_read_only_bytes_like_decode() -> None:
    codec = get_codec("int8")
    x = torch.randn(4, 16, 4, 32)
    enc = codec.encode(x, Kind.VALUE)
    payload, scales = bytes(enc.payload.numpy()), bytes(enc.scales.numpy())  # as a gRPC message holds them
    got = codec.decode_buffer_into(Kind.VALUE, tuple(x.shape), memoryview(payload), memoryview(scales), None,
                                   torch.empty(x.shape, dtype=torch.bfloat16))
    assert torch.equal(got, codec.decode(enc, torch.bfloat16))
    with pytest.raises(CodecError, match="payload has 8191 bytes, expected 8192"):
        codec.decode_buffer_into(Kind.VALUE, tuple(x.shape), payload[:-1], scales, None,
                                 torch.empty(x.shape, dtype=torch.bfloat16))
    with pytest.raises(CodecError, match="scales has"):
        codec.decode_buffer_into(Kind.VALUE, tuple(x.shape), payload, scales[:-4], None,
                                 torch.empty(x.shape, dtype=torch.bfloat16))
    with pytest.raises(CodecError, match="destination shape"):
        codec.decode_buffer_into(Kind.VALUE, tuple(x.shape), payload, scales, None,
                                 torch.empty(2, 16, 4, 32, dtype=torch.bfloat16))


def test_native_kernels_can_be_switched_off(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvtransfer.codecs import native

    monkeypatch.setenv("EPD_NATIVE_KERNELS", "0")
    assert native._build_and_load() is None
