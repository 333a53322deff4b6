"""Device names as the engine holds them, and the CUDA device its work is launched on.

A configured ``cuda`` names no index, while every CUDA tensor reports one (``cuda:0``), and the two
compare unequal. So the model and the KV cache hold the resolved device, and a check that a tensor is
on the cache's device compares like with like.

Triton kernels and CUDA graph capture run on the thread's *current* CUDA device, not on their tensors'
device, and each thread starts on device 0. ``on_device`` makes the engine's device current around its
work (``kvtransfer.staging.on_device``, shared with the KV path), so ``cuda:1`` runs on GPU 1 whichever
thread calls the engine.
"""

from __future__ import annotations

import torch

from kvtransfer.staging import on_device

__all__ = ["memory_baseline", "note_memory_baseline", "on_device", "resolve_device"]


def resolve_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: ``cuda`` becomes the current CUDA device (``cuda:0`` unless a thread set
    another). Unchanged when it names an index, is not CUDA, or CUDA is not available here."""
    resolved = torch.device(device)
    if resolved.type == "cuda" and resolved.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return resolved


# Per CUDA device index: (bytes in use on the device, bytes torch's allocator reserved in this process) when
# this process first put a model on it. What others held then is not this process's to count.
_memory_baselines: dict[int, tuple[int, int]] = {}


def note_memory_baseline(device: torch.device) -> None:
    """Record, once per process and CUDA device, the device's memory in use before this process loads a model
    there (``memory_baseline``); nothing for other devices."""
    if device.type != "cuda":
        return
    index = resolve_device(device).index
    assert index is not None
    if index not in _memory_baselines:
        free, total = torch.cuda.mem_get_info(index)
        _memory_baselines[index] = (total - free, torch.cuda.memory_reserved(index))


def memory_baseline(device: torch.device) -> tuple[int, int]:
    """(bytes in use on the device, bytes torch reserved here) when this process first loaded a model on it;
    (0, 0) when it never noted one, which counts everything in use as this process's."""
    return _memory_baselines.get(resolve_device(device).index or 0, (0, 0))
