"""The codecs' fused Triton kernels, addressed by cache block index: launch wrappers and dispatch.

``encode_blocks(codec, cache, ids, kind, payload)`` encodes blocks ``ids`` of ``cache``
[num_blocks, block_size, kv_heads, head_dim] (float32/bf16) into ``payload`` (1-D uint8 of the
codec's layout size, same device) and returns the ``EncodedTensor`` (scales and zeros allocated on
that device). ``decode_blocks(enc, cache, ids)`` writes the decoded blocks straight into cache
blocks ``ids``. Both produce exactly the torch codecs' bytes and values (tests hold them to it under
``TRITON_INTERPRET=1``) and refuse non-finite input with the same ``CodecError``.

Every encode also reads a quantised cache (``paged.QuantizedBlocks``: codes and a scale per (token,
head)), dequantising as it reads, with the torch codec's bytes over ``QuantizedBlocks.gather``;
``encodes_from`` says whether a codec's blocks are read straight from a given cache, ``decodes_into``
whether they are decoded straight into one.

``usable(device)``: True on a CUDA device when Triton imports, or under ``TRITON_INTERPRET=1``
(the interpreter runs them on CPU tensors: that is how they are tested without a GPU). This module is
a ``base.BlockKernels``: the registry builds each codec in ``FUSED_CODECS`` with it, and the codec calls
it for CUDA tensors; CPU tensors keep the torch (and native C) kernels.
"""

from __future__ import annotations

import functools
import os
from typing import Any

import torch

from kvtransfer.codecs.base import Codec, raise_non_finite
from kvtransfer.codecs.encoded import CodecError, EncodedTensor, Kind
from kvtransfer.codecs.paged import QuantizedBlocks
from kvtransfer.staging import on_device

__all__ = ["FUSED_CODECS", "decode_blocks", "decodes_into", "encode_blocks", "encode_blocks_unchecked", "encodes_from",
           "refuse", "usable"]

FUSED_CODECS = ("int8", "fp8", "int4", "bf16", "fp32")


@functools.cache
def _triton_ok() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def usable(device: torch.device) -> bool:
    if not _triton_ok():
        return False
    if os.environ.get("TRITON_INTERPRET") == "1":
        return True
    return device.type == "cuda"


def _p2(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def _tokens(bs: int, width: int) -> int:
    """Tokens per tile: a tile holds about 4096 elements (a power of two, at most the block)."""
    return max(1, min(_p2(bs), 4096 // width))


def _launch(kernel: Any, grid: tuple[int, ...], *args: object, **meta: object) -> None:  # a @triton.jit kernel
    """Launch on the first tensor argument's device (Triton launches on the thread's current device)."""
    # fp-fusion off: a multiply then add must round twice, as the torch codecs do (see triton_common)
    if os.environ.get("TRITON_INTERPRET") != "1":
        meta["enable_fp_fusion"] = False
    device = next(a.device for a in args if isinstance(a, torch.Tensor))
    with on_device(device):
        kernel[grid](*args, **meta)


def encodes_from(codec: Codec, cache: torch.Tensor | QuantizedBlocks) -> bool:
    """True when ``codec`` (as the registry built it) encodes blocks straight from ``cache`` (a float
    cache or a quantised one) with these kernels: a CUDA cache, where they are usable, of a codec they
    cover. Otherwise the caller gathers the blocks and encodes them with the codec."""
    return codec._fused(cache.data if isinstance(cache, QuantizedBlocks) else cache) is not None


def decodes_into(codec: Codec, cache: torch.Tensor) -> bool:
    """True when ``codec`` (as the registry built it) decodes straight into blocks of ``cache`` (a float
    cache) with ``decode_blocks``: a CUDA cache, where these kernels are usable, of a codec they cover.
    Otherwise the caller decodes with the codec and copies the result into the blocks."""
    return codec._fused(cache) is not None


def _check(codec: Codec, cache: torch.Tensor | QuantizedBlocks, ids: torch.Tensor) -> tuple[int, int, int, int]:
    if isinstance(cache, torch.Tensor) and (cache.dim() != 4 or cache.dtype not in (torch.float32, torch.bfloat16)):
        raise CodecError(f"cache must be float32/bf16 [num_blocks, block_size, kv_heads, head_dim], got "
                         f"{cache.dtype} {tuple(cache.shape)}")
    if ids.device != cache.device or ids.dtype != torch.long or ids.dim() != 1:
        raise CodecError(f"block ids must be a 1-D long tensor on the cache's device {cache.device}, got "
                         f"{ids.dtype} on {ids.device}")
    _, bs, h, d = cache.shape
    return codec._check_shape((ids.numel(), bs, h, d))


def _source(cache: torch.Tensor | QuantizedBlocks) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...], int, bool]:
    """The encode kernels' source arguments: the tensor read, the scales read (the tensor itself, never
    read, for a float cache), the scales' strides, SRC and ROUND_BF16 (triton_common._load_src)."""
    if not isinstance(cache, QuantizedBlocks):
        return cache, cache, (0, 0, 0), 0, False
    fp8 = cache.data.dtype == torch.float8_e4m3fn
    src = cache.data.view(torch.uint8) if fp8 else cache.data
    return src, cache.scales, tuple(cache.scales.stride()), 2 if fp8 else 1, cache.dtype == torch.bfloat16


def encode_blocks(codec: Codec, cache: torch.Tensor | QuantizedBlocks, ids: torch.Tensor, kind: Kind | str,
                  payload: torch.Tensor) -> EncodedTensor:
    enc, flags = encode_blocks_unchecked(codec, cache, ids, kind, payload)
    refuse(codec, enc.scales, flags)
    return enc


def refuse(codec: Codec, scales: torch.Tensor, flags: torch.Tensor | None) -> None:
    """Raise the torch codec's CodecError when an encode's outputs say its input was refused: int8/fp8 by a
    non-finite scale, int4/bf16/fp32 by their per-program ``flags``. On device tensors this waits for the encode;
    a caller that must not wait copies them to the host first (they are small)."""
    if codec.name in ("int8", "fp8"):
        _refuse_non_finite_scales(codec, scales)
    elif codec.name == "int4":
        assert flags is not None
        _refuse_int4(codec, flags)
    elif codec.name in ("bf16", "fp32"):
        assert flags is not None
        if bool(flags.any()):
            raise_non_finite(codec.name)


def encode_blocks_unchecked(codec: Codec, cache: torch.Tensor | QuantizedBlocks, ids: torch.Tensor,
                            kind: Kind | str, payload: torch.Tensor) -> tuple[EncodedTensor, torch.Tensor | None]:
    """``encode_blocks`` without waiting for the kernels: the encoded tensor, and the int4/bf16/fp32 refusal
    flags (None for int8/fp8); hand both to ``refuse`` once they are ready. Launch-only: no host sync."""
    kind = Kind.parse(kind)
    shape = _check(codec, cache, ids)
    layout = codec._layout(shape, kind)
    if payload.device != cache.device or payload.dtype != torch.uint8 or payload.numel() != layout.payload_nbytes:
        raise CodecError(f"payload must be {layout.payload_nbytes} uint8 bytes on {cache.device}")
    n, bs, h, d = shape
    dev = cache.device
    scales = torch.empty(layout.scales_shape, dtype=layout.scales_dtype, device=dev)
    zeros = None
    flags = None
    name = codec.name
    src, sscale, sstrides, mode, round_bf16 = _source(cache)
    in_bf16 = src.dtype == torch.bfloat16
    if name in ("bf16", "fp32") and mode == 0:  # these two move bits: a float cache is read as integers
        src = src.view(torch.int16 if in_bf16 else torch.int32)
    args = (bs, h, d, *src.stride(), *sstrides)
    quantised = {"SRC": mode, "ROUND_BF16": round_bf16}
    if name == "int8":
        from kvtransfer.codecs.triton_int8_fp8 import int8_encode_kernel
        bd = _p2(d)
        _launch(int8_encode_kernel, (n, h), src, sscale, ids, payload.view(torch.int8), scales, *args,
                BT=_tokens(bs, bd), BD=bd, **quantised)
    elif name == "fp8":
        from kvtransfer.codecs.triton_int8_fp8 import fp8_encode_kernel
        be = _p2(h * d)
        _launch(fp8_encode_kernel, (n,), src, sscale, ids, payload, scales, *args, BT=_tokens(bs, be), BE=be,
                **quantised)
    elif name == "int4":
        from kvtransfer.codecs.int4 import key_group, value_group
        from kvtransfer.codecs.triton_int4 import int4_key_encode_kernel, int4_value_encode_kernel
        zeros = torch.empty(layout.zeros_shape, dtype=layout.scales_dtype, device=dev)  # type: ignore[arg-type]  # int4 always has a zeros shape
        s16, z16 = scales.view(torch.int16), zeros.view(torch.int16)
        if kind is Kind.KEY:
            g = key_group(bs)
            flags = torch.empty((n, bs // g, h), dtype=torch.int32, device=dev)
            _launch(int4_key_encode_kernel, (n, bs // g, h), src, sscale, ids, payload, s16, z16, flags, bs, h, d,
                    g, *args[3:], BG=_p2(g), BJ=_p2(d // 2), **quantised)
        else:
            g = value_group(d)
            bn, bh = _p2(d // g), _p2(g // 2)
            bt = _tokens(bs, 2 * bn * bh)
            tiles = -(-bs // bt)
            flags = torch.empty((n, tiles, h), dtype=torch.int32, device=dev)
            _launch(int4_value_encode_kernel, (n, tiles, h), src, sscale, ids, payload, s16, z16, flags, bs, h, d,
                    g, *args[3:], BT=bt, BN=bn, BH=bh, **quantised)
    elif name == "bf16":
        from kvtransfer.codecs.triton_bf16 import bf16_encode_kernel
        flags = torch.empty(n, dtype=torch.int32, device=dev)
        be = _p2(h * d)
        _launch(bf16_encode_kernel, (n,), src, sscale, ids, payload.view(torch.int16), flags, *args,
                BT=_tokens(bs, be), BE=be, IN_BF16=in_bf16, **quantised)
    elif name == "fp32":
        from kvtransfer.codecs.triton_fp32 import fp32_encode_kernel
        flags = torch.empty(n, dtype=torch.int32, device=dev)
        be = _p2(h * d)
        _launch(fp32_encode_kernel, (n,), src, sscale, ids, payload.view(torch.int32), flags, *args,
                BT=_tokens(bs, be), BE=be, IN_BF16=in_bf16, **quantised)
    else:
        raise CodecError(f"codec {name!r} has no fused kernels (fused: {', '.join(FUSED_CODECS)})")
    return EncodedTensor(codec.codec_id, kind, shape, payload, scales, zeros), flags


def decode_blocks(codec: Codec, enc: EncodedTensor, cache: torch.Tensor, ids: torch.Tensor) -> None:
    codec.check(enc)
    shape = _check(codec, cache, ids)
    if shape != enc.shape:
        raise CodecError(f"{ids.numel()} block ids for an encoded tensor of shape {enc.shape}")
    for part in (enc.payload, enc.scales, enc.zeros):
        if part is not None and part.device != cache.device:
            raise CodecError(f"encoded parts must be on the cache's device {cache.device}, got {part.device}")
    n, bs, h, d = shape
    strides = tuple(cache.stride())
    name = codec.name
    out_bf16 = cache.dtype == torch.bfloat16
    # bf16 is stored as rounded bits (triton_common); fp32's payload lands as float32 bits, untouched
    cache = cache.view(torch.int16) if out_bf16 else cache.view(torch.int32) if name == "fp32" else cache
    if name == "int8":
        from kvtransfer.codecs.triton_int8_fp8 import int8_decode_kernel
        bd = _p2(d)
        _launch(int8_decode_kernel, (n, h), enc.payload.view(torch.int8), enc.scales, cache, ids, bs, h, d, *strides,
                BT=_tokens(bs, bd), BD=bd, OUT_BF16=out_bf16)
    elif name == "fp8":
        from kvtransfer.codecs.triton_int8_fp8 import fp8_decode_kernel
        be = _p2(h * d)
        _launch(fp8_decode_kernel, (n,), enc.payload, enc.scales, cache, ids, bs, h, d, *strides,
                BT=_tokens(bs, be), BE=be, OUT_BF16=out_bf16)
    elif name == "int4":
        from kvtransfer.codecs.int4 import key_group, value_group
        from kvtransfer.codecs.triton_int4 import int4_decode_kernel
        is_key = enc.kind is Kind.KEY
        g = key_group(bs) if is_key else value_group(d)
        assert enc.zeros is not None
        bj = _p2(d // 2)
        _launch(int4_decode_kernel, (n, h), enc.payload, enc.scales, enc.zeros, cache, ids, bs,
                h, d, g, is_key, *strides, BT=_tokens(bs, bj), BJ=bj, OUT_BF16=out_bf16)
    elif name == "bf16":
        from kvtransfer.codecs.triton_bf16 import bf16_decode_kernel
        be = _p2(h * d)
        _launch(bf16_decode_kernel, (n,), enc.payload.view(torch.int16), cache, ids, bs, h, d, *strides,
                BT=_tokens(bs, be), BE=be, OUT_BF16=out_bf16)
    elif name == "fp32":
        from kvtransfer.codecs.triton_fp32 import fp32_decode_kernel
        be = _p2(h * d)
        _launch(fp32_decode_kernel, (n,), enc.payload.view(torch.int32), cache, ids, bs, h, d, *strides,
                BT=_tokens(bs, be), BE=be, OUT_BF16=out_bf16)
    else:
        raise CodecError(f"codec {name!r} has no fused kernels (fused: {', '.join(FUSED_CODECS)})")


def _refuse_non_finite_scales(codec: Codec, scales: torch.Tensor) -> None:
    if not bool(torch.isfinite(scales).all()):
        raise_non_finite(codec.name)


def _refuse_int4(codec: Codec, flags: torch.Tensor) -> None:
    """The torch int4 codec's refusals, in its order: non-finite, then the minimum, then the scale."""
    from kvtransfer.codecs.int4 import _F16_MAX

    bits = [bool((flags & bit).any()) for bit in (1, 2, 4)]
    if bits[0]:
        raise_non_finite(codec.name)
    if bits[1]:
        raise CodecError(f"int4: a group's minimum is beyond float16's range (|min| must be <= {_F16_MAX:g})")
    if bits[2]:
        raise CodecError(f"int4: a group's range / 15 is beyond float16's range ({_F16_MAX:g})")
