"""``non_finite_values``: the receiver's check that a well-formed, correctly checksummed chunk does not
carry values a correct sender never sends (NaN/inf scales, NaN fp8 bytes)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvtransfer.chunks import non_finite_values
from kvtransfer.codecs import Kind, get_codec

pytestmark = pytest.mark.unit


def _parts(codec: str) -> tuple[torch.dtype, bytearray, bytearray]:
    c = get_codec(codec)
    x = torch.randn(3, 32, 2, 64, generator=torch.Generator().manual_seed(1))
    k, v = c.encode(x, Kind.KEY), c.encode(x, Kind.VALUE)
    scales = b"".join(bytes(m) for m in (k.scales_view(), k.zeros_view(), v.scales_view(), v.zeros_view())
                      if m is not None)
    dtype = c.layout(tuple(x.shape), Kind.KEY).scales_dtype
    return dtype, bytearray(scales), bytearray(bytes(k.payload_view()) + bytes(v.payload_view()))


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4", "bf16", "fp32"])
def test_what_a_correct_sender_encodes_passes(codec: str) -> None:
    dtype, scales, payload = _parts(codec)
    assert non_finite_values(codec, dtype, memoryview(scales), memoryview(payload)) is None
    assert non_finite_values(codec, dtype, memoryview(bytes(scales)), memoryview(bytes(payload))) is None  # read-only


@pytest.mark.parametrize("codec", ["int8", "fp8", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_non_finite_scale_is_named(codec: str, bad: float) -> None:
    dtype, scales, payload = _parts(codec)
    view = np.frombuffer(scales, dtype=np.float16 if dtype == torch.float16 else np.float32)
    view[len(view) // 2] = bad
    assert non_finite_values(codec, dtype, memoryview(scales), memoryview(payload)) == "its scales hold NaN or inf"


@pytest.mark.parametrize("nan_byte", [0x7F, 0xFF])
def test_a_nan_fp8_byte_is_named_and_the_largest_finite_ones_pass(nan_byte: int) -> None:
    dtype, scales, payload = _parts("fp8")
    payload[5] = 0x7E  # +448 and -448, the largest finite e4m3fn values
    payload[6] = 0xFE
    assert non_finite_values("fp8", dtype, memoryview(scales), memoryview(payload)) is None
    payload[len(payload) - 1] = nan_byte
    assert non_finite_values("fp8", dtype, memoryview(scales), memoryview(payload)) == "its fp8 payload holds NaN"
    # the same byte is an ordinary value in an int8 payload
    assert non_finite_values("int8", dtype, memoryview(scales), memoryview(payload)) is None
