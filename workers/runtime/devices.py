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

__all__ = ["device_problem", "memory_baseline", "note_memory_baseline", "on_device", "resolve_device"]


def device_problem(device: torch.device | str) -> str | None:
    """None when this process can put tensors on ``device``; else why not, in words (CUDA missing or not
    built into this torch, an index past the GPUs it sees, MPS missing)."""
    device = torch.device(device)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            built = "sees no GPU" if torch.backends.cuda.is_built() else "is built without CUDA"
            return f"CUDA is not available here (this torch {built})"
        if device.index is not None and device.index >= torch.cuda.device_count():
            return f"this machine has {torch.cuda.device_count()} CUDA device(s)"
    if device.type == "mps" and not torch.backends.mps.is_available():
        return "MPS is not available here"
    return None


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
