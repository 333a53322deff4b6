"""The device checksum's Triton kernel (kvtransfer.triton_checksum) against its definition, computed here in
Python integers, and against the torch reference: sizes that end mid-word, span several programs or start
off a word boundary, words whose products wrap past 2**64, and a flipped bit anywhere.

Without CUDA the kernel runs on CPU through Triton's interpreter (tests.unit.triton_env); with CUDA the
same tests run the compiled kernel on the GPU."""

from __future__ import annotations

import pytest
import torch

from kvtransfer import device_checksum as dc
from tests.unit.triton_env import DEVICE

pytestmark = pytest.mark.unit


def _definition(data: torch.Tensor) -> int:
    raw = bytes(data.cpu().tolist())
    raw += bytes((-len(raw)) % 4)
    words = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw), 4)]
    total = sum(w * (2 * ((i * 0x9E3779B1) % 2**32) + 1) for i, w in enumerate(words)) % 2**64
    return total ^ ((data.numel() * 0xC2B2AE3D27D4EB4F) % 2**64)


@pytest.mark.parametrize("n", [1, 3, 4, 7, 64, 1003, 4 * 4096, 4 * 4096 + 2, 3 * 4 * 4096 + 17])
def test_the_kernel_gives_the_definition_and_the_reference(n: int) -> None:
    gen = torch.Generator().manual_seed(n)
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=gen)
    want = _definition(data)
    assert dc.reference_checksum(data) == want
    assert dc.kernel_checksum(data.to(DEVICE)) == want


def test_products_and_sums_wrap_as_unsigned_64_bit() -> None:
    data = torch.full((5 * 4096 * 4,), 0xFF, dtype=torch.uint8)  # every word 2**32 - 1: every sum wraps
    assert dc.kernel_checksum(data.to(DEVICE)) == dc.reference_checksum(data) == _definition(data)


def test_a_slice_off_a_word_boundary_is_checksummed_as_its_own_bytes() -> None:
    base = torch.randint(0, 256, (4 * 4096 + 40,), dtype=torch.uint8, generator=torch.Generator().manual_seed(3))
    data = base.to(DEVICE)[1:-6]
    assert data.data_ptr() % 4
    assert dc.kernel_checksum(data) == _definition(base[1:-6])


def test_every_flipped_bit_changes_it() -> None:
    n = 2 * 4 * 4096 + 3  # two programs and a partial last word
    data = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    good = dc.kernel_checksum(data)
    for pos, bit in ((0, 0), (4 * 4096 - 1, 7), (4 * 4096, 3), (n - 4, 6), (n - 1, 1)):
        bad = data.clone()
        bad[pos] ^= 1 << bit
        assert dc.kernel_checksum(bad) != good, (pos, bit)
    assert dc.kernel_checksum(data[:-1]) != good  # a shorter message with the same words so far


def test_an_empty_tensor_and_bad_arguments() -> None:
    assert dc.kernel_checksum(torch.empty(0, dtype=torch.uint8, device=DEVICE)) == 0
    for bad in (torch.zeros(8, dtype=torch.int32), torch.zeros(2, 4, dtype=torch.uint8)):
        with pytest.raises(ValueError, match="1-D uint8"):
            dc.kernel_checksum(bad.to(DEVICE))


def test_device_checksum_takes_the_kernel_on_cuda_and_torch_on_cpu(monkeypatch) -> None:
    data = torch.randint(0, 256, (1000,), dtype=torch.uint8, generator=torch.Generator().manual_seed(9))
    taken: list[str] = []

    def kernel(t: torch.Tensor) -> int:
        taken.append(t.device.type)
        return 0
    monkeypatch.setattr(dc, "kernel_checksum", kernel)
    dc.device_checksum(data)
    assert taken == []  # a CPU tensor: the torch reference, also under the interpreter
    if DEVICE.type == "cuda":
        dc.device_checksum(data.to(DEVICE))
        assert taken == ["cuda"]
