"""The CUDA IPC transport: KV chunks written device to device into the receiver's GPU memory.

Receiver (decode worker): ``IpcPool`` holds a few device segments and a random ``epoch``. A push leases
one segment for its request id (on the push's authenticated bulk connection, or ``OpenCudaIpc`` on the
authenticated gRPC channel), its handshake
names the epoch and the segment, its chunks name offsets into it (``KVChunk.shm``) and a
``device_checksum``; the receiver checks each chunk there, on the GPU, and decodes it by block index
into the reserved blocks. The lease ends with the push (``release``). A restarted decode worker has a
new epoch: a handshake with another epoch is refused, and the sender drops its old mappings.

Sender (prefill worker): ``IpcMappings`` opens each exported handle once per (receiver, epoch,
segment) and reuses the mapping; a lease with a new epoch for a receiver closes the old ones.

Handles travel as ``CudaIpcHandle`` protobuf fields (torch.multiprocessing.reductions' public
reduce/rebuild functions), never pickled.
"""

from __future__ import annotations

import secrets
import socket
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import grpc
import torch

from kvtransfer.codecs import WireLayout
from kvtransfer.codecs.encoded import cut_pair
from kvtransfer.device_checksum import device_checksum
from kvtransfer.errors import TransferRefused
from kvtransfer.staging import side_stream
from kvtransfer.wire import pb

Code = grpc.StatusCode

__all__ = ["IPC_ALIGNMENT", "IPC_SEGMENTS", "IPC_SEGMENT_BYTES", "DeviceParts", "IpcError", "IpcMappings", "IpcPool",
           "MappedSegment", "device_chunk_parts", "device_uuid"]


# Where each chunk starts in a segment: a multiple of this, so its scales are viewed as float32 in place
IPC_ALIGNMENT = 16

# Pools of this process by epoch (weakly: a stopped receiver's pool goes). CUDA refuses to open an IPC
# handle in the process that exported it, so a sender next to its receiver (DisaggPair) maps nothing.
_LOCAL_POOLS: weakref.WeakValueDictionary[int, IpcPool] = weakref.WeakValueDictionary()


class IpcError(ValueError):
    """A lease that cannot be given or used; the message names why."""


def device_uuid(device: torch.device) -> str:
    """The GPU's UUID (stable across processes, unlike its index under CUDA_VISIBLE_DEVICES); "" on CPU."""
    if device.type != "cuda":
        return ""
    return str(torch.cuda.get_device_properties(device).uuid)


@dataclass
class _Lease:
    segment: int
    request_id: str
    in_push: bool = False  # a handshake named it: the push's own end releases it (_Session.close)


# A decode worker's pool: four pushes at once of up to 256 MiB of encoded KV each.
IPC_SEGMENT_BYTES = 256 * 2**20
IPC_SEGMENTS = 4
# A segment whose push ended before its finish (refused, cancelled, expired) rests this long, from the end
# of its stream, before it is leased again: its sender's encoder threads write ahead and learn of the end
# from the receiver's answer, and a late write must not land in the next push's bytes.
IPC_QUARANTINE_S = 5.0


class IpcPool:
    """Device segments leased one per push. ``epoch`` is random per pool: a new process, a new epoch.
    A lease ends clean (the push's finish arrived: its sender wrote everything it will) or not; a segment
    whose lease did not end clean is leased again only ``quarantine_s`` seconds later."""

    def __init__(self, device: torch.device, segment_bytes: int = IPC_SEGMENT_BYTES,
                 num_segments: int = IPC_SEGMENTS, quarantine_s: float = IPC_QUARANTINE_S) -> None:
        if segment_bytes <= 0 or num_segments <= 0:
            raise IpcError(f"an IPC pool needs positive sizes, got {num_segments} x {segment_bytes} bytes")
        self.device = device
        self.epoch = secrets.randbits(63) | 1
        self.host = socket.gethostname()
        self.uuid = device_uuid(device)
        self.segment_bytes = segment_bytes
        self.segments = [torch.empty(segment_bytes, dtype=torch.uint8, device=device) for _ in range(num_segments)]
        # Exported once per segment: each export takes a slot in torch's IPC ref-counter file
        self._handles: dict[int, pb.CudaIpcHandle] = {}
        self._free = list(range(num_segments - 1, -1, -1))
        self._resting: list[tuple[float, int]] = []  # (monotonic time it may be leased again, segment)
        self.quarantine_s = quarantine_s
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()
        _LOCAL_POOLS[self.epoch] = self  # a sender in this process uses the segments as they are

    def lease(self, request_id: str, min_bytes: int) -> pb.CudaIpcLease:
        """Lease a free segment to ``request_id``'s push; IpcError when none is free or it is too small."""
        if min_bytes > self.segment_bytes:
            raise IpcError(f"the push needs {min_bytes} bytes; this receiver's IPC segments hold {self.segment_bytes}")
        with self._lock:
            if request_id in self._leases:
                raise IpcError(f"request {request_id!r} already holds an IPC segment")
            now = time.monotonic()
            self._free.extend(seg for until, seg in self._resting if until <= now)
            self._resting = [(until, seg) for until, seg in self._resting if until > now]
            if not self._free:
                resting = f" ({len(self._resting)} resting after an unfinished push)" if self._resting else ""
                raise IpcError(f"all {len(self.segments)} IPC segments are in use{resting}; retry or use another "
                               "transport")
            seg = self._free.pop()
            self._leases[request_id] = _Lease(seg, request_id)
            handle = self._handles.get(seg)
            if handle is None:
                handle = self._handles[seg] = export_handle(self.segments[seg])
        return pb.CudaIpcLease(pool_epoch=self.epoch, host=self.host, device_uuid=self.uuid, segment=seg,
                               segment_bytes=self.segment_bytes, handle=handle)

    def check(self, request_id: str, epoch: int, segment: int) -> torch.Tensor:
        """The segment a handshake names, after checking it is this pool's epoch and that request's lease."""
        if epoch != self.epoch:
            raise IpcError(f"stale CUDA IPC mapping: the handshake names pool epoch {epoch:#x}, this receiver's "
                           f"is {self.epoch:#x} (it restarted); lease a segment again")
        with self._lock:
            lease = self._leases.get(request_id)
            if lease is None or lease.segment != segment:
                raise IpcError(f"request {request_id!r} holds no lease on IPC segment {segment}")
            lease.in_push = True
        return self.segments[segment]

    def release(self, request_id: str, clean: bool = False) -> None:
        """End ``request_id``'s lease, if it holds one. ``clean``: its push's finish arrived, so no write
        of its sender can still be on its way; otherwise the segment rests ``quarantine_s`` first."""
        with self._lock:
            lease = self._leases.pop(request_id, None)
            if lease is None:
                return
            if clean or self.quarantine_s <= 0:
                self._free.append(lease.segment)
            else:
                self._resting.append((time.monotonic() + self.quarantine_s, lease.segment))

    def release_stale(self, alive: Callable[[str], bool]) -> None:
        """Release the leases of requests no longer alive whose push never began (refused, expired, the
        sender gone). A lease a push holds ends with that push (its stream may still be receiving, and its
        sender writing, after the request is over), so its rest starts only then."""
        with self._lock:
            stale = [rid for rid, lease in self._leases.items() if not lease.in_push and not alive(rid)]
        for rid in stale:
            self.release(rid)

    @property
    def resting(self) -> int:
        """Segments resting after a push that ended before its finish."""
        with self._lock:
            now = time.monotonic()
            return sum(until > now for until, _ in self._resting)

    @property
    def leased(self) -> int:
        with self._lock:
            return len(self._leases)


def export_handle(t: torch.Tensor) -> pb.CudaIpcHandle:
    """The IPC handle of a CUDA tensor's storage (empty on CPU: such a pool is only for tests)."""
    if t.device.type != "cuda":
        return pb.CudaIpcHandle()
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(t)
    (_, _, _, _, _, _, _, handle, size_bytes, offset_bytes, _, ref_handle, ref_offset, event, event_sync) = args
    return pb.CudaIpcHandle(handle=handle, storage_bytes=size_bytes, offset_bytes=offset_bytes,
                            ref_counter_handle=ref_handle, ref_counter_offset=ref_offset, event_handle=event or b"",
                            event_sync_required=bool(event_sync))


class IpcMappings:
    """The sender's open mappings, per (target, epoch, segment), for the ``max_targets`` receivers pushed to
    most recently: a mapping keeps its memory alive, so those of receivers replaced long ago (a new worker has
    a new address, so the old one is never asked again) are dropped rather than kept for the process's life."""

    def __init__(self, max_targets: int = 64) -> None:
        self.max_targets = max_targets
        self._maps: dict[tuple[str, int, int], torch.Tensor] = {}
        self._recent: dict[str, None] = {}  # targets, least recently pushed to first
        self._lock = threading.Lock()

    @property
    def targets(self) -> tuple[str, ...]:
        """The targets with open mappings, least recently pushed to first."""
        with self._lock:
            return tuple(t for t in self._recent if any(k[0] == t for k in self._maps))

    def open(self, target: str, lease: pb.CudaIpcLease) -> torch.Tensor:
        """The leased segment as a 1-D uint8 tensor on this process's view of the receiver's GPU."""
        key = (target, lease.pool_epoch, lease.segment)
        with self._lock:
            seg = self._maps.get(key)
            if seg is not None:
                self._touch(target)
                return seg
            for old in [k for k in self._maps if k[0] == target and k[1] != lease.pool_epoch]:
                del self._maps[old]  # that receiver restarted: its old memory is gone
        local = _LOCAL_POOLS.get(lease.pool_epoch)
        if local is not None and lease.segment < len(local.segments):
            seg = local.segments[lease.segment]  # the receiver is in this process: CUDA opens no handle here
        else:
            seg = _rebuild(lease, _local_device(lease.device_uuid))
        with self._lock:  # recorded only once mapped, so a failed open evicts no other target
            self._maps[key] = seg
            self._touch(target)
        return seg

    def _touch(self, target: str) -> None:
        """Under the lock: ``target`` is the most recent; the mappings of targets past ``max_targets`` go."""
        self._recent.pop(target, None)
        self._recent[target] = None
        for gone in list(self._recent)[:-self.max_targets]:
            del self._recent[gone]
            for k in [k for k in self._maps if k[0] == gone]:
                del self._maps[k]

    def close(self) -> None:
        with self._lock:
            self._maps.clear()
            self._recent.clear()


def _local_device(uuid: str) -> torch.device:
    if not torch.cuda.is_available():
        raise IpcError("CUDA IPC needs CUDA on the sender")
    for i in range(torch.cuda.device_count()):
        if str(torch.cuda.get_device_properties(i).uuid) == uuid:
            return torch.device("cuda", i)
    raise IpcError(f"the receiver's GPU {uuid} is not visible to this process")


def _rebuild(lease: pb.CudaIpcLease, device: torch.device) -> torch.Tensor:
    """The inverse of ``export_handle``'s ``reduce_tensor``: its arguments in its order. Every handle goes
    as bytes (torch's ``_new_shared_cuda`` takes nothing else; an event handle is ignored unless
    ``event_sync_required``)."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    h = lease.handle
    return rebuild_cuda_tensor(torch.Tensor, (lease.segment_bytes,), (1,), 0, torch.storage.TypedStorage, torch.uint8,
                               device.index, h.handle, h.storage_bytes, h.offset_bytes, False,
                               h.ref_counter_handle, h.ref_counter_offset, h.event_handle, h.event_sync_required)


@dataclass(frozen=True)
class DeviceParts:
    """One tensor's encoded parts as they lie in device memory (1-D uint8 slices), for the sink."""

    payload: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None


def non_finite_device(codec_name: str, scales_dtype: torch.dtype, scales: torch.Tensor,
                      payload: torch.Tensor) -> str | None:
    """``chunks.non_finite_values`` for bytes in device memory, computed there."""
    if scales.numel() and not bool(torch.isfinite(scales.view(scales_dtype)).all()):
        return "its scales hold NaN or inf"
    if codec_name == "fp8" and payload.numel() and bool(((payload & 0x7F) == 0x7F).any()):
        return "its fp8 payload holds NaN"
    return None


@dataclass(frozen=True)
class MappedSegment:
    """A leased receiver segment as the sending stream holds it."""

    tensor: torch.Tensor  # 1-D uint8, the receiver's device memory mapped into this process
    epoch: int
    index: int

    @property
    def size(self) -> int:
        return self.tensor.numel()


def lease_request(request_id: str, min_bytes: int) -> bytes:
    return pb.CudaIpcLeaseRequest(request_id=request_id, min_bytes=min_bytes).SerializeToString()


def device_chunk_parts(segment: torch.Tensor, c: pb.KVChunk, where: str, codec_name: str, k_lay: WireLayout,
                       v_lay: WireLayout, want_scales: int, want_payload: int) -> tuple[DeviceParts, DeviceParts]:
    """A TRANSPORT_CUDA_IPC chunk's keys' and values' parts in the leased ``segment``, after checking where
    they lie: the range against the segment and the codec's sizes, the offset's alignment, the device checksum,
    finite scales (and no NaN fp8 byte). Raises TransferRefused naming ``where``."""
    if c.shm.length != want_scales + want_payload or c.shm.offset + c.shm.length > segment.numel():
        raise TransferRefused(Code.OUT_OF_RANGE, f"{where}: bytes {c.shm.offset}+{c.shm.length} do not fit the "
                                                 f"{segment.numel()}-byte IPC segment or the codec's "
                                                 f"{want_scales}+{want_payload} bytes")
    if c.shm.offset % IPC_ALIGNMENT:
        raise TransferRefused(Code.INVALID_ARGUMENT, f"{where}: offset {c.shm.offset} in the IPC segment is not a "
                                                     f"multiple of {IPC_ALIGNMENT} (scales are read in place)")
    data = segment[c.shm.offset:c.shm.offset + c.shm.length]
    scales, payload = data[:want_scales], data[want_scales:]
    with side_stream(segment.device, independent=True):  # another process wrote it: no wait for this one's engine
        checksum = device_checksum(data)
        problem = None if checksum != c.checksum else non_finite_device(codec_name, k_lay.scales_dtype, scales,
                                                                        payload)
    if checksum != c.checksum:
        raise TransferRefused(Code.DATA_LOSS, f"{where}: checksum mismatch, the data was corrupted")
    if problem is not None:
        raise TransferRefused(Code.INVALID_ARGUMENT, f"{where}: {problem}; refusing to land a corrupt KV cache")
    k, v = cut_pair(k_lay, v_lay, scales, payload)
    return DeviceParts(*k), DeviceParts(*v)
