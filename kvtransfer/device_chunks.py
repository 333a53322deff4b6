"""KV chunks encoded straight from a paged cache on its device, then moved out without waiting the engine.

``encode_from_cache`` runs on the caller's (the engine's) stream in its layer hook: the fused kernels read
the chunk's blocks by index from the layer's cache and write the wire's bulk bytes (keys' then values'
scales and zeros, then the keys' and values' payload) into one device buffer. It only launches work: no
host sync, so the engine goes on with the next layer. Being on the engine's stream, it reads the blocks
before anything later can overwrite them; the buffer is the chunk's snapshot, smaller than the raw blocks.

An encoder thread then finishes the chunk on the side stream (after the encode's event):
``to_host_checked`` copies the bytes into a host buffer (pinned, or a shared-memory segment) and checks the
refusals there (NaN/inf input, int4 out of range) with the torch codec's message; ``to_device_checked``
copies them into a mapped CUDA IPC segment instead, and takes their checksum there. A CPU cache (or a GPU
without Triton) encodes through the codec itself from a gathered copy (the same bytes). A quantised cache
layer (``QuantizedBlocks``) is read the same way, its codes and scales dequantised as the kernels read them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvtransfer.codecs import Codec, EncodedTensor, Kind, fused
from kvtransfer.codecs.paged import QuantizedBlocks
from kvtransfer.device_checksum import device_checksum
from kvtransfer.staging import side_stream, to_host, wait_for_current

__all__ = ["CacheBlocks", "DeviceChunk", "block_nbytes", "encode_from_cache", "to_device_checked", "to_host_checked"]

CacheBlocks = torch.Tensor | QuantizedBlocks  # one layer's keys or values: a float cache, or a quantised one


@dataclass(frozen=True)
class DeviceChunk:
    """One chunk's wire bytes on the device, with what is needed to check it once copied out."""

    data: torch.Tensor  # 1-D uint8: scales and zeros (keys, values), keys' payload, values' payload
    codec: Codec
    num_blocks: int
    scales_nbytes: int  # the leading scales-and-zeros part of ``data``
    flags: tuple[torch.Tensor | None, torch.Tensor | None]  # keys', values' refusal flags (int4, bf16)
    ready: torch.cuda.Event | None  # the event after the encode (None on CPU)
    deferred: bool  # encoded by the fused kernels: refusals are checked once copied out


def block_nbytes(cache: CacheBlocks) -> int:
    """Bytes one block of ``cache`` holds (a quantised one: codes and scales)."""
    return cache.block_nbytes() if isinstance(cache, QuantizedBlocks) else cache[0].nbytes


def encode_from_cache(codec: Codec, k_cache: CacheBlocks, v_cache: CacheBlocks, ids: torch.Tensor) -> DeviceChunk:
    """Launch the encode of blocks ``ids`` of ``k_cache``/``v_cache`` ([num_blocks, block, heads, dim], float32
    or bf16, or a ``QuantizedBlocks``, on the device ``ids`` is on) into a new device buffer. Raises CodecError
    only where the codec encodes eagerly (a CPU cache, or no fused kernels), whose refusals come at once."""
    n = ids.numel()
    shape = (n, *k_cache.shape[1:])
    k_lay, v_lay = codec.layout(shape, Kind.KEY), codec.layout(shape, Kind.VALUE)
    s_len = k_lay.scale_nbytes + k_lay.zero_nbytes + v_lay.scale_nbytes + v_lay.zero_nbytes
    data = torch.empty(s_len + k_lay.payload_nbytes + v_lay.payload_nbytes, dtype=torch.uint8, device=ids.device)
    k_pay = data[s_len:s_len + k_lay.payload_nbytes]
    v_pay = data[s_len + k_lay.payload_nbytes:]
    flags: list[torch.Tensor | None] = [None, None]
    deferred = fused.encodes_from(codec, k_cache)
    if deferred:
        k, flags[0] = fused.encode_blocks_unchecked(codec, k_cache, ids, Kind.KEY, k_pay)
        v, flags[1] = fused.encode_blocks_unchecked(codec, v_cache, ids, Kind.VALUE, v_pay)
    else:
        k = codec.encode_into(_gather(k_cache, ids), Kind.KEY, k_pay)
        v = codec.encode_into(_gather(v_cache, ids), Kind.VALUE, v_pay)
    _put_scales(data, k, v)
    return DeviceChunk(data, codec, n, s_len, (flags[0], flags[1]), wait_for_current(ids.device), deferred)


def _gather(cache: CacheBlocks, ids: torch.Tensor) -> torch.Tensor:
    return cache.gather(ids) if isinstance(cache, QuantizedBlocks) else cache.index_select(0, ids)


def _put_scales(data: torch.Tensor, k: EncodedTensor, v: EncodedTensor) -> None:
    pos = 0
    for t in (k.scales, k.zeros, v.scales, v.zeros):
        if t is not None and t.numel():
            nbytes = t.numel() * t.element_size()
            data[pos:pos + nbytes].copy_(t.reshape(-1).view(torch.uint8))
            pos += nbytes


def to_host_checked(chunk: DeviceChunk, host: torch.Tensor) -> None:
    """Copy the chunk's bytes into ``host`` (1-D uint8 of the chunk's size; pinned for an asynchronous copy)
    on the side stream, then refuse it (CodecError) if its input was NaN/inf or out of int4's range."""
    with side_stream(chunk.data.device, chunk.ready):
        to_host(chunk.data, host)
        flags = [None if f is None else f.to("cpu", non_blocking=False) for f in chunk.flags]
    _refuse(chunk, host, flags)


def to_device_checked(chunk: DeviceChunk, dest: torch.Tensor) -> int:
    """``to_host_checked`` into device memory ``dest`` (a mapped CUDA IPC segment's range), on the side stream
    too; returns the ``device_checksum`` of what landed there (of the same bytes here when ``dest`` is on
    another GPU; the receiver checks what landed)."""
    with side_stream(chunk.data.device, chunk.ready):
        dest.copy_(chunk.data)
        # summed on this stream's device: what landed, or the same bytes here when dest is on another GPU
        checksum = device_checksum(dest if dest.device == chunk.data.device else chunk.data)
        scales = chunk.data[:chunk.scales_nbytes].to("cpu")
        flags = [None if f is None else f.to("cpu") for f in chunk.flags]
    _refuse(chunk, scales, flags)
    return checksum


def _refuse(chunk: DeviceChunk, host: torch.Tensor, flags: list[torch.Tensor | None]) -> None:
    """The codec's refusals from host copies of the scales (a prefix of ``host``) and the flags."""
    if not chunk.deferred:
        return  # encoded eagerly: refused at once
    scales = host[:chunk.scales_nbytes]
    values = scales.view(torch.float16 if chunk.codec.name == "int4" else torch.float32) if scales.numel() else scales
    for f in flags:
        fused.refuse(chunk.codec, values, f)
