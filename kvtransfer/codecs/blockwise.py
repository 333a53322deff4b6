"""`BlockwiseCodec`: the chunked encode/decode loop shared by the quantising codecs.

Each kernel call covers as many whole blocks as fit in CHUNK_ELEMENTS and is one vectorised
pass over all of them and all their heads. Why chunks at all: the kernels work in float32
scratch; allocated once per call at chunk size it stays in cache and is reused, instead of a
fresh temporary twice the input's size page-faulting in on every op.
"""

from __future__ import annotations

import abc

import torch

from kvtransfer.codecs.base import Codec, Shape
from kvtransfer.codecs.encoded import EncodedTensor, Kind, WireLayout

__all__ = ["CHUNK_ELEMENTS", "BlockwiseCodec"]

# Elements per kernel call: 2 MiB of float32 scratch, small enough to stay in a core's cache.
CHUNK_ELEMENTS = 1 << 19


class BlockwiseCodec(Codec):
    """A codec whose scales never span blocks, so any run of whole blocks encodes on its own."""

    @abc.abstractmethod
    def _encode_chunk(
        self,
        xf: torch.Tensor,
        rows: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        kind: Kind,
        aux: torch.Tensor | None,
    ) -> None:
        """Encode float32 blocks `xf` [c, block, heads, dim] (scratch: clobber it) into output slices.

        rows: payload bytes [c, bytes_per_block]; scales/zeros: the layout's shapes, first dim c;
        aux: the kernel's own scratch from `_aux`, or None. Raises CodecError on NaN/inf.
        """

    @abc.abstractmethod
    def _decode_chunk(
        self,
        rows: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        kind: Kind,
        out: torch.Tensor,
        aux: torch.Tensor | None,
    ) -> None:
        """Decode payload rows [c, bytes_per_block] into contiguous float32 `out` [c, block, heads, dim].

        aux: the kernel's own scratch from `_aux`, or None.
        """

    def _aux(self, numel: int, device: torch.device) -> torch.Tensor | None:
        """Extra kernel scratch for chunks of up to `numel` elements, allocated once per call.

        None by default. torch.empty touches no pages, so a side that leaves it unused pays nothing.
        """
        return None

    def _encode(self, x: torch.Tensor, kind: Kind, layout: WireLayout) -> EncodedTensor:
        payload = torch.empty(layout.payload_nbytes, dtype=torch.uint8, device=x.device)
        return self._encode_into(x, kind, layout, payload)

    def _encode_into(self, x: torch.Tensor, kind: Kind, layout: WireLayout, payload: torch.Tensor) -> EncodedTensor:
        shape: Shape = tuple(x.shape)  # type: ignore[assignment]  # a KV tensor is 4-D
        scales = torch.empty(layout.scales_shape, dtype=layout.scales_dtype, device=x.device)
        zeros = None
        if layout.zeros_shape is not None:
            zeros = torch.empty(layout.zeros_shape, dtype=layout.scales_dtype, device=x.device)
        rows = payload.view(shape[0], -1)
        step = _blocks_per_chunk(shape)
        c_max = min(step, shape[0])
        scratch = torch.empty((c_max, *shape[1:]), dtype=torch.float32, device=x.device)
        aux = self._aux(scratch.numel(), x.device)
        for i in range(0, shape[0], step):
            sl = slice(i, i + step)
            xf = scratch[: rows[sl].shape[0]]
            xf.copy_(x[sl])
            self._encode_chunk(xf, rows[sl], scales[sl], None if zeros is None else zeros[sl], kind, aux)
        return EncodedTensor(self.codec_id, kind, shape, payload, scales, zeros)

    def _decode_into(self, enc: EncodedTensor, out: torch.Tensor) -> None:
        shape = enc.shape
        rows = enc.payload.view(shape[0], -1)
        step = _blocks_per_chunk(shape)
        c_max = min(step, shape[0])
        direct = out.dtype == torch.float32 and out.is_contiguous() and out.device == enc.payload.device
        scratch = None
        if not direct:
            scratch = torch.empty((c_max, *shape[1:]), dtype=torch.float32, device=enc.payload.device)
        aux = self._aux(c_max * shape[1] * shape[2] * shape[3], enc.payload.device)
        for i in range(0, shape[0], step):
            sl = slice(i, i + step)
            c = rows[sl].shape[0]
            dst = out[sl] if scratch is None else scratch[:c]
            zeros = None if enc.zeros is None else enc.zeros[sl]
            self._decode_chunk(rows[sl], enc.scales[sl], zeros, enc.kind, dst, aux)
            if scratch is not None:
                out[sl].copy_(dst)


def _blocks_per_chunk(shape: tuple[int, ...]) -> int:
    return max(1, CHUNK_ELEMENTS // (shape[1] * shape[2] * shape[3]))
