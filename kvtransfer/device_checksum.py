"""The checksum of bytes in device memory (CUDA IPC chunks), computed where they lie.

``device_checksum(data)``: a 64-bit checksum of a 1-D uint8 tensor, equal on every device and whichever
implementation computes it: the sum over 32-bit little-endian words ``w_i`` (the last one padded with
zero bytes) of ``w_i * (2 * (i * 0x9E3779B1 mod 2**32) + 1)`` modulo 2**64, xor the length times
0xC2B2AE3D27D4EB4F. Any change of one word changes it (the factors are odd).

On a CUDA tensor, where Triton is usable, one kernel reads the bytes once (``kernel_checksum``,
``triton_checksum``); otherwise ``reference_checksum``, in torch, computes it (and is what the kernel is
tested against). Either way it returns once the value is on the host: it waits for the
work queued on the current stream before it."""

from __future__ import annotations

import torch

from kvtransfer.codecs import fused
from kvtransfer.staging import on_device

__all__ = ["device_checksum", "kernel_checksum", "reference_checksum"]

_MASK64 = (1 << 64) - 1
_FACTOR = 0x9E3779B1
_LENGTH = 0xC2B2AE3D27D4EB4F
_BLOCK = 4096  # words per program: 16 KiB read by each


def _check(data: torch.Tensor) -> torch.Tensor:
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise ValueError(f"device_checksum takes a 1-D uint8 tensor, got {data.dtype} {tuple(data.shape)}")
    return data if data.data_ptr() % 4 == 0 else data.clone()  # a word view needs 4-byte alignment


def _finish(total: int, n: int) -> int:
    return ((total & _MASK64) ^ (n * _LENGTH)) & _MASK64


def reference_checksum(data: torch.Tensor) -> int:
    """``device_checksum`` in torch ops, on the tensor's device."""
    data = _check(data)
    n = data.numel()
    pad = (-n) % 4
    if pad:
        data = torch.cat([data, torch.zeros(pad, dtype=torch.uint8, device=data.device)])
    words = data.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    idx = torch.arange(words.numel(), dtype=torch.int64, device=data.device)
    factors = ((idx * _FACTOR) & 0xFFFFFFFF) * 2 + 1
    return _finish(int((words * factors).sum()), n)


def device_checksum(data: torch.Tensor) -> int:
    """The checksum of ``data`` (1-D uint8, any device): ``kernel_checksum`` for a CUDA tensor where Triton is
    usable, ``reference_checksum`` otherwise (CPU tensors keep torch, as the codecs do)."""
    if data.device.type == "cuda" and fused.usable(data.device):
        return kernel_checksum(data)
    return reference_checksum(data)


def kernel_checksum(data: torch.Tensor) -> int:
    """``device_checksum`` by the Triton kernel, on a CUDA tensor, or on any tensor under ``TRITON_INTERPRET=1``
    (how it is tested without a GPU)."""
    from kvtransfer.triton_checksum import checksum_kernel

    data = _check(data)
    n = data.numel()
    n_words = n // 4
    total = 0
    if n_words:
        programs = -(-n_words // _BLOCK)
        partial = torch.empty(programs, dtype=torch.int64, device=data.device)
        with on_device(data.device):  # Triton launches on the current device
            checksum_kernel[(programs,)](data[:n_words * 4].view(torch.int32), partial, n_words, BLOCK=_BLOCK,
                                         num_warps=8)
        total = int(partial.sum())  # int64 addition wraps: the partials' sum modulo 2**64
    if n % 4:  # the last word, padded with zero bytes
        tail = int.from_bytes(bytes(data[n_words * 4:].tolist()), "little")
        total += tail * (2 * ((n_words * _FACTOR) & 0xFFFFFFFF) + 1)
    return _finish(total, n)
