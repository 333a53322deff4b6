"""Moving encoded KV bytes between a device and host memory, for transports that leave the device.

Contracts:
- Only encoded bytes cross (payload, scales, zeros): never a raw cache tensor, never a Python
  ``bytes`` built from a device tensor.
- Device to host (sender): the copy runs on a side stream that first waits for what the caller's
  stream had queued, into a pinned buffer from ``PinnedPool`` (reused across chunks and requests),
  so it overlaps the next layer's compute; ``to_host`` returns once the bytes are on the host.
- Host to device (receiver): received bytes are copied once into a pinned buffer, then to the
  device on a side stream; ``to_device`` returns once the device tensor holds them, so the pinned
  buffer can be reused at once.
- For a CPU device everything here is a plain copy (no pinning, no streams): the CPU path's buffers
  are the ones it had before.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext

import numpy as np
import torch

from kvtransfer.memory import BufferPool

__all__ = ["PinnedPool", "index_on", "on_device", "side_stream", "to_device", "to_host", "wait_for_current"]

_threads = threading.local()


def _side(device: torch.device) -> torch.cuda.Stream:
    """This thread's side stream on ``device``: one per (thread, device), so a thread's wait at the end of
    its block never includes another thread's work (an encoder's copy queued behind the prefill engine's
    layers, a receiver's landing)."""
    streams: dict[torch.device, torch.cuda.Stream] | None = getattr(_threads, "streams", None)
    if streams is None:
        streams = _threads.streams = {}
    stream = streams.get(device)
    if stream is None:
        stream = streams[device] = torch.cuda.Stream(device=device)
    return stream


def on_device(device: torch.device) -> AbstractContextManager[object]:
    """A context making ``device`` the thread's current CUDA device (restored on exit, without creating a
    CUDA context on the device restored); does nothing for any other device type. Triton launches, graph
    capture and device-less CUDA calls follow the current device, which is 0 in every new thread."""
    if device.type == "cuda":
        return torch.cuda.device(device)
    return nullcontext()


@contextmanager
def side_stream(device: torch.device, after: torch.cuda.Event | None = None, *,
                independent: bool = False) -> Iterator[None]:
    """Run the block's device work on this thread's side stream for the device; on exit (an exception too),
    wait until it is done.

    ``after``: a ``torch.cuda.Event`` the side stream waits for first (recorded where the inputs were
    produced); None waits for everything the current stream had queued, unless ``independent``: the block
    reads nothing the current stream produced and writes nothing its queued work uses (bytes received from
    the host or another process, landing in reserved blocks), so it waits for none of it: a receiver on a
    decode worker then never waits for the engine's step in flight. A landing passes the cache's
    ``free_fence`` as ``after``: the engine's work queued before its blocks were freed. Tensors the
    block allocates come from the side stream's memory. A CPU device runs as is."""
    if device.type != "cuda":
        yield
        return
    stream = _side(device)
    if after is not None:
        stream.wait_event(after)
    elif not independent:
        stream.wait_stream(torch.cuda.current_stream(device))
    try:
        # the device first: leaving a bare stream context sets the thread's previous device (0) with
        # cudaSetDevice, which creates a CUDA context there in a process that works on another GPU
        with on_device(device), torch.cuda.stream(stream):
            yield
    finally:
        stream.synchronize()


def wait_for_current(device: torch.device) -> torch.cuda.Event | None:
    """An event marking what the current stream has queued so far (None on CPU): hand it to
    ``side_stream(after=...)`` on another thread so the side stream starts after that work."""
    if device.type != "cuda":
        return None
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


def index_on(device: torch.device, values: list[int]) -> torch.Tensor:
    """``values`` as a 1-D long tensor on ``device``, without waiting for the device: on CUDA the list goes
    into pinned host memory and is copied on the current stream with ``non_blocking`` (``torch.tensor(values,
    device=cuda)`` copies from pageable memory, which waits for everything queued on the stream first: in a
    layer hook, that stalls the engine's launches behind the GPU). Later work on that stream sees the values;
    PyTorch keeps the pinned memory until the copy is done."""
    if device.type != "cuda":
        return torch.tensor(values, dtype=torch.long, device=device)
    return torch.tensor(values, dtype=torch.long, device="cpu", pin_memory=True).to(device, non_blocking=True)


class PinnedPool(BufferPool):
    """``BufferPool`` of page-locked host buffers (1-D uint8), so device copies from and to them run
    asynchronously. Without CUDA the buffers are ordinary host memory."""

    def _allocate(self, nbytes: int) -> torch.Tensor:
        return torch.empty(max(1, nbytes), dtype=torch.uint8, device="cpu", pin_memory=torch.cuda.is_available())


_RECEIVE_POOL = PinnedPool(64 * 2**20)


def to_host(src: torch.Tensor, dest: torch.Tensor) -> None:
    """Copy the 1-D uint8 device tensor ``src`` into the host tensor ``dest`` (same size; pinned for
    an asynchronous copy). Call inside ``side_stream`` (it synchronises at its end) or on CPU."""
    if dest.device.type != "cpu" or src.numel() != dest.numel():
        raise ValueError(f"to_host needs a host destination of {src.numel()} bytes, got {dest.device} "
                         f"{dest.numel()}")
    dest.copy_(src, non_blocking=dest.is_pinned())


def to_device(parts: list[memoryview | None], device: torch.device) -> list[torch.Tensor | None]:
    """Received byte buffers as 1-D uint8 tensors on ``device`` (None stays None). On CPU the writable
    bytes are copied into one host buffer; on CUDA into one pinned buffer, then moved with one
    transfer, done before this returns. Each part starts 16-byte aligned (viewable as float32)."""
    sizes = [0 if p is None else p.nbytes for p in parts]
    starts = []
    total = 0
    for n in sizes:  # each part 16-byte aligned, so it can be viewed as float32/float16
        starts.append(total)
        total += -(-n // 16) * 16
    host = _RECEIVE_POOL.take(total) if device.type == "cuda" else torch.empty(total, dtype=torch.uint8, device="cpu")
    try:
        view = host.numpy()
        for p, n, pos in zip(parts, sizes, starts):
            if n:
                view[pos:pos + n] = np.frombuffer(p, dtype=np.uint8)  # type: ignore[arg-type]  # n > 0 only for a part that is present
        if device.type == "cuda":
            # allocated on the caller's stream, which uses it next: the allocator then never hands its memory
            # to other work before the caller's is done (the side stream's copy is, when side_stream exits)
            flat = torch.empty(total, dtype=torch.uint8, device=device)
            with side_stream(device):
                flat.copy_(host[:total], non_blocking=True)
        else:
            flat = host[:total]
    finally:
        if device.type == "cuda":
            _RECEIVE_POOL.give(host)
    return [None if p is None else flat[pos:pos + n] for p, n, pos in zip(parts, sizes, starts)]
