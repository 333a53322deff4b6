"""Lands received KV blocks in the decode engine's paged cache (the ``KVSink`` of kvtransfer).

Per layer, by what the cache stores there:
  - a float layer (fp32/bf16): lossless codecs of the same dtype are copied byte for byte;
    anything else is decoded into the blocks (dequantised);
  - an int8/fp8 layer receiving that same codec: payload and scales are stored as they are
    (``native``: the capacity gain of a quantised cache, no dequantise/requantise);
  - any other pairing (int4, bf16, fp32 into int8/fp8; int8 into fp8; fp8 into int8): re-quantised per
    (token, head) as the cache writes it. The device path (a CUDA cache, or ``staged`` under
    ``TRITON_INTERPRET=1``) does it in one fused kernel (``workers.runtime.kernels.kv_requant``) that
    reads the received parts and writes codes and scales straight into the blocks; the host path, and a
    device without Triton, decode to float32 and call ``storage.write`` (``_requantise``), the reference
    the kernel equals bit for bit. Either refuses a chunk that decodes to NaN or inf and writes nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from contextlib import AbstractContextManager
from typing import Literal

import numpy as np
import torch

from kvtransfer.codecs import Codec, EncodedTensor, Kind, fused, get_codec
from kvtransfer.codecs.encoded import CodecError, non_finite_landing
from kvtransfer.cuda_ipc import DeviceParts
from kvtransfer.receiver import WireParts
from kvtransfer.staging import index_on, side_stream, to_device
from workers.runtime.kv_cache import DenseLayerStorage, KVLayerStorage, PagedKVCache, QuantizedLayerStorage, block_slots

_RAW = {("fp32", torch.float32), ("bf16", torch.bfloat16)}
_NATIVE = {("int8", "int8"), ("fp8", "fp8")}
_NUMPY_SCALES = {torch.float32: np.float32, torch.float16: np.float16}  # the dtypes codecs send scales in
KVStore = Literal["dequantize", "native"]


def decode_cache_dtypes(codecs: tuple[str, ...], compute_dtype: str, store: KVStore) -> tuple[str, ...]:
    """The decode cache's dtype per layer: ``native`` keeps int8/fp8 layers quantised as received
    (more tokens per byte of pool), ``dequantize`` stores every layer in the compute dtype. int4
    layers are always dequantised (the cache has no int4 storage)."""
    if store == "dequantize":
        return (compute_dtype,) * len(codecs)
    return tuple(c if c in ("int8", "fp8") else compute_dtype for c in codecs)


def check_decoded_range(storage: KVLayerStorage, codec_name: str, shape: tuple[int, int, int, int],
                        key: WireParts | DeviceParts, value: WireParts | DeviceParts, read_dtype: torch.dtype) -> None:
    """ValueError when a chunk's scales (and zero points) could decode a code to a magnitude past what the
    layer holds: the largest value of ``read_dtype`` (the dtype attention reads every layer in) and, for a
    dense layer, of its own dtype. Finite scales of 3e38 would still land inf (in a dense layer, or when an
    int8/fp8 layer is read), which poisons every later step of the request. A pass over the scales only,
    before anything is written; codecs without scales (bf16, fp32) are checked by the sender."""
    codec = get_codec(codec_name)
    if not codec.max_code:
        return
    limit = torch.finfo(read_dtype).max
    if isinstance(storage, DenseLayerStorage):
        limit = min(limit, torch.finfo(storage.k.dtype).max)
    scales_dtype = codec.layout(shape, Kind.KEY).scales_dtype
    reach = [_reach(part, scales_dtype, codec.max_code) for part in (key, value)]
    magnitudes = (torch.stack([torch.as_tensor(r) for r in reach]).tolist()  # device parts: one sync for both
                  if isinstance(reach[0], torch.Tensor) else [float(r) for r in reach])
    for name, magnitude in zip(("keys", "values"), magnitudes):
        if magnitude > limit:
            raise ValueError(f"the {name}' scales decode to magnitudes up to {magnitude:.3g}, past {limit:.3g}, the "
                             f"largest the cache's layer holds; refusing to land inf in the KV cache")


def _reach(part: WireParts | DeviceParts, dtype: torch.dtype, max_code: float) -> float | torch.Tensor:
    """The largest magnitude ``part``'s codes can decode to: per group, max(|zero|, |zero + max_code * scale|)
    (or max_code * |scale| without zero points), largest over the groups; read from host bytes or, for
    device parts, computed there (a 0-d tensor, not synchronised)."""
    if isinstance(part.scales, torch.Tensor):
        s = part.scales.view(dtype).float()
        if not s.numel():
            return s.new_zeros(())
        if part.zeros is None:
            return s.abs().amax() * max_code
        z = part.zeros.view(dtype).float()
        return torch.maximum(z.abs(), (z + max_code * s).abs()).amax()
    s_np = np.frombuffer(part.scales, dtype=_NUMPY_SCALES[dtype]).astype(np.float64)
    if not s_np.size:
        return 0.0
    if part.zeros is None:
        return float(np.abs(s_np).max()) * max_code
    z_np = np.frombuffer(part.zeros, dtype=_NUMPY_SCALES[dtype]).astype(np.float64)
    return float(np.maximum(np.abs(z_np), np.abs(z_np + max_code * s_np)).max())


class CacheSink:
    """``staged``: land chunks through the device path (received bytes copied to the cache's device,
    decoded there by block index); None picks it for any cache not on the CPU. True on a CPU cache
    runs the same logic on CPU tensors, which is how it is tested without a GPU."""

    def __init__(self, cache: PagedKVCache, staged: bool | None = None) -> None:
        self.cache = cache
        self.bs = cache.block_size
        self.staged = cache.device.type != "cpu" if staged is None else staged

    def write(self, layer: int, blocks: Sequence[int], codec: str, shape: tuple[int, int, int, int],
              key: WireParts, value: WireParts) -> None:
        storage = self.cache.layers[layer]
        check_decoded_range(storage, codec, shape, key, value, self.cache.read_dtype)
        if self.staged:
            with self._landing():  # done (synchronised) before the receiver counts the chunk
                self._write_device(storage, blocks, codec, shape, key, value)
            return
        if isinstance(storage, DenseLayerStorage) and (codec, storage.k.dtype) in _RAW:
            for dest, part in ((storage.k, key), (storage.v, value)):
                self._copy_raw(dest, blocks, part.payload, shape)
            return
        if isinstance(storage, QuantizedLayerStorage) and (codec, storage.dtype_name) in _NATIVE:
            self._store_native(storage, blocks, codec, shape, key, value)
            return
        c = get_codec(codec)
        if isinstance(storage, DenseLayerStorage) and _consecutive(blocks):
            # dequantise straight into the blocks from the received bytes: no temporary, no scatter
            first, n = blocks[0], len(blocks)
            for kind, part, dest in ((Kind.KEY, key, storage.k), (Kind.VALUE, value, storage.v)):
                c.decode_buffer_into(kind, shape, part.payload, part.scales, part.zeros,
                                     dest.view(-1, self.bs, *dest.shape[1:])[first:first + n])
            return
        k_enc = c.from_buffer(Kind.KEY, shape, key.payload, key.scales, key.zeros)
        v_enc = c.from_buffer(Kind.VALUE, shape, value.payload, value.scales, value.zeros)
        if isinstance(storage, QuantizedLayerStorage):
            _requantise(storage, self._slots(blocks), c, k_enc, v_enc)
            return
        dtype = storage.k.dtype if isinstance(storage, DenseLayerStorage) else torch.float32
        k, v = c.decode(k_enc, dtype), c.decode(v_enc, dtype)
        storage.write(self._slots(blocks), k.reshape(-1, *shape[2:]), v.reshape(-1, *shape[2:]))

    def write_device(self, layer: int, blocks: Sequence[int], codec: str, shape: tuple[int, int, int, int],
                     key: DeviceParts, value: DeviceParts) -> None:
        """Parts already in the cache's device memory (a CUDA IPC segment): decoded from there."""
        dev = self.cache.device
        parts = (key.payload, key.scales, key.zeros, value.payload, value.scales, value.zeros)
        if any(p is not None and p.device != dev for p in parts):
            raise ValueError(f"received parts must be on the cache's device {dev}")
        with self._landing():  # checked there on the same stream (cuda_ipc.device_chunk_parts)
            check_decoded_range(self.cache.layers[layer], codec, shape, key, value,  # on the side stream too
                                self.cache.read_dtype)
            self._land_device(self.cache.layers[layer], blocks, codec, shape, parts)

    def _landing(self) -> AbstractContextManager[None]:
        """The side stream received bytes land on: into reserved blocks only, so it waits for none of the
        engine's queued steps, only for what it queued before the blocks were last freed
        (``PagedKVCache.free_fence``)."""
        return side_stream(self.cache.device, after=self.cache.free_fence, independent=True)

    def _write_device(self, storage: KVLayerStorage, blocks: Sequence[int], codec: str,
                      shape: tuple[int, int, int, int], key: WireParts, value: WireParts) -> None:
        """A device cache: only the received encoded bytes go host to device (one staged copy per
        chunk), then they land as in ``_land_device``."""
        parts = to_device([key.payload, key.scales, key.zeros, value.payload, value.scales, value.zeros],
                          self.cache.device)
        self._land_device(storage, blocks, codec, shape, tuple(parts))

    def _land_device(self, storage: KVLayerStorage, blocks: Sequence[int], codec: str,
                     shape: tuple[int, int, int, int], parts: tuple[torch.Tensor | None, ...]) -> None:
        """Encoded parts on the cache's device: the fused kernels decode (or re-quantise) straight into
        the reserved blocks, or the payload and scales are stored as they are; every index lives on that
        device."""
        dev = self.cache.device
        n, bs, h, d = shape
        if blocks and (min(blocks) < 0 or max(blocks) >= self.cache.num_blocks):
            # the kernels write where the ids point: checked here, on the host list, before any launch
            raise ValueError(f"block ids {min(blocks)}..{max(blocks)} outside the cache's {self.cache.num_blocks}")
        ids = index_on(dev, list(blocks))  # on the side stream, with the kernels that read it
        kp, ks, kz, vp, vs, vz = parts
        assert kp is not None and ks is not None and vp is not None and vs is not None  # only zeros may be absent
        if isinstance(storage, DenseLayerStorage) and (codec, storage.k.dtype) in _RAW:
            per_block = bs * h * d * storage.k.element_size()
            for dest, p in ((storage.k, kp), (storage.v, vp)):
                if p.numel() != per_block * n:
                    raise ValueError(f"payload of {p.numel()} bytes for {n} blocks of {per_block}")
                dest.view(torch.uint8).view(-1, per_block).index_copy_(0, ids, p.view(n, per_block))
            return
        if isinstance(storage, QuantizedLayerStorage) and (codec, storage.dtype_name) in _NATIVE:
            groups = h if codec == "int8" else 1
            for data, scale, p, sc in ((storage.k, storage.k_scale, kp, ks), (storage.v, storage.v_scale, vp, vs)):
                if p.numel() != n * bs * h * d or sc.numel() != n * groups * 4:
                    raise CodecError(f"payload/scales have {p.numel()}/{sc.numel()} bytes, expected "
                                     f"{n * bs * h * d}/{n * groups * 4} for {n} {codec} blocks")
                data.view(torch.uint8).view(-1, bs * h * d).index_copy_(0, ids, p.view(n, -1))
                s = sc.view(torch.float32).view(n, 1, groups).expand(n, bs, h)
                scale.view(-1, bs, h).index_copy_(0, ids, s.contiguous())
            return
        c = get_codec(codec)
        k_enc = _encoded(c, Kind.KEY, shape, kp, ks, kz)
        v_enc = _encoded(c, Kind.VALUE, shape, vp, vs, vz)
        if isinstance(storage, DenseLayerStorage):
            for enc, dest in ((k_enc, storage.k), (v_enc, storage.v)):
                blocks_view = dest.view(-1, bs, h, d)
                if fused.decodes_into(c, blocks_view):
                    fused.decode_blocks(c, enc, blocks_view, ids)  # straight into the reserved blocks
                else:
                    blocks_view.index_copy_(0, ids, c.decode(enc, dest.dtype))
            return
        if not isinstance(storage, QuantizedLayerStorage):  # make_layer_storage builds no other kind
            raise TypeError(f"no device landing for a {type(storage).__name__} layer")
        if c.name in fused.FUSED_CODECS and fused.usable(dev):
            from workers.runtime.kernels.kv_requant import land_requantised  # imports triton: only here

            land_requantised(c, k_enc, v_enc, storage, bs, ids)  # dequantise + quantise, straight into the blocks
            return
        _requantise(storage, block_slots(list(blocks), bs, dev), c, k_enc, v_enc)

    def _slots(self, blocks: Sequence[int]) -> torch.Tensor:
        return block_slots(list(blocks), self.bs, self.cache.device)

    def _copy_raw(self, dest: torch.Tensor, blocks: Sequence[int], payload: memoryview,
                  shape: tuple[int, int, int, int]) -> None:
        """Byte copy into the blocks, one memcpy per run of consecutive block ids (no temporaries)."""
        per_block = dest[0].nbytes * self.bs
        if payload.nbytes != per_block * len(blocks):
            raise ValueError(f"payload of {payload.nbytes} bytes for {len(blocks)} blocks of {per_block}")
        src = np.frombuffer(payload, dtype=np.uint8).reshape(len(blocks), per_block)
        dst = dest.view(-1, self.bs * dest.shape[1] * dest.shape[2]).view(torch.uint8).numpy()
        for start, end, first in _runs(blocks):
            np.copyto(dst[first:first + end - start], src[start:end])

    def _store_native(self, storage: QuantizedLayerStorage, blocks: Sequence[int], codec: str,
                      shape: tuple[int, int, int, int], key: WireParts, value: WireParts) -> None:
        """Payload bytes copied as they are, one memcpy per run of consecutive block ids; the scales
        (int8: per (block, head), fp8: per block) broadcast to the cache's one per (token, head)."""
        n, bs, h, d = shape
        per_block = bs * h * d
        groups = h if codec == "int8" else 1
        runs = _runs(blocks)
        for data, scale, part in ((storage.k, storage.k_scale, key), (storage.v, storage.v_scale, value)):
            if part.payload.nbytes != n * per_block:
                raise CodecError(f"payload has {part.payload.nbytes} bytes, expected {n * per_block} for {n} "
                                 f"{codec} blocks")
            if part.scales.nbytes != n * groups * 4:
                raise CodecError(f"scales have {part.scales.nbytes} bytes, expected {n * groups * 4} for {n} "
                                 f"{codec} blocks")
            src = np.frombuffer(part.payload, dtype=np.uint8).reshape(n, per_block)
            dst = data.view(torch.uint8).view(-1, per_block).numpy()
            s = torch.from_numpy(np.frombuffer(part.scales, dtype=np.float32).reshape(n, 1, groups).copy())
            s_dst = scale.view(-1, bs, h)
            for start, end, first in runs:
                np.copyto(dst[first:first + end - start], src[start:end])
                s_dst[first:first + end - start].copy_(s[start:end].expand(-1, bs, h))


def _requantise(storage: QuantizedLayerStorage, slots: torch.Tensor, c: Codec, key: EncodedTensor,
                value: EncodedTensor) -> None:
    """The torch path of a non-native codec into a quantised layer, and the fused kernel's reference:
    decode to float32, refuse NaN/inf (nothing written), then the cache's own per-(token, head) write."""
    h, d = key.shape[2], key.shape[3]
    k, v = c.decode(key, torch.float32), c.decode(value, torch.float32)
    if not bool(torch.isfinite(k).all() and torch.isfinite(v).all()):
        raise non_finite_landing(c.name, storage.dtype_name)
    storage.write(slots, k.reshape(-1, h, d), v.reshape(-1, h, d))


def _encoded(c: Codec, kind: Kind, shape: tuple[int, int, int, int], payload: torch.Tensor, scales: torch.Tensor,
             zeros: torch.Tensor | None) -> EncodedTensor:
    """Received parts already on the device as an EncodedTensor, every length checked against ``shape``."""
    layout = c.layout(shape, kind)
    for what, t, want in (("payload", payload, layout.payload_nbytes), ("scales", scales, layout.scale_nbytes),
                          ("zeros", zeros, layout.zero_nbytes)):
        got = 0 if t is None else t.numel()
        if got != want:
            raise CodecError(f"{what} has {got} bytes, expected {want} for this codec, shape and kind")
    z = None if layout.zeros_shape is None else zeros.view(layout.scales_dtype).view(layout.zeros_shape)  # type: ignore[union-attr]  # a zeros shape means zeros were checked present
    s = scales.view(layout.scales_dtype).view(layout.scales_shape) if scales.numel() else torch.empty(
        layout.scales_shape, dtype=layout.scales_dtype, device=scales.device)
    return EncodedTensor(c.codec_id, kind, shape, payload, s, z)


def _consecutive(blocks: Sequence[int]) -> bool:
    return all(b == blocks[0] + i for i, b in enumerate(blocks))


def _runs(blocks: Sequence[int]) -> list[tuple[int, int, int]]:
    """(start, end, first block id) of each maximal run of consecutive ids in ``blocks``."""
    runs = []
    start = 0
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[i - 1] + 1:
            runs.append((start, i, blocks[start]))
            start = i
    return runs
