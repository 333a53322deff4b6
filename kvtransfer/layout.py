"""KVLayout: what a sender's KV cache looks like, exchanged in the handshake.

The receiver refuses a layout it cannot store: a different model (fingerprint), layer count,
head count, head size or block size. Codecs are the sender's choice per layer; the receiver only
checks that it knows them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtransfer.codecs import CodecError, get_codec, get_codec_by_id
from kvtransfer.wire import pb

CACHE_DTYPES = {"float32": pb.DTYPE_FLOAT32, "bfloat16": pb.DTYPE_BFLOAT16, "float16": pb.DTYPE_FLOAT16}
_DTYPE_NAMES = {v: k for k, v in CACHE_DTYPES.items()}


class LayoutMismatch(ValueError):
    """The two sides' caches cannot exchange blocks; the message names the first difference."""


@dataclass(frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    layer_codecs: tuple[str, ...]  # codec name per layer
    model_fingerprint: str
    cache_dtype: str = "float32"

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            if getattr(self, name) <= 0:
                raise LayoutMismatch(f"layout: {name} must be positive, got {getattr(self, name)}")
        if len(self.layer_codecs) != self.num_layers:
            raise LayoutMismatch(f"layout names {len(self.layer_codecs)} codecs for {self.num_layers} layers")
        for name in self.layer_codecs:
            get_codec(name)  # raises CodecError for an unknown name
        if self.cache_dtype not in CACHE_DTYPES:
            raise LayoutMismatch(f"layout: unknown cache dtype {self.cache_dtype!r}")

    def block_shape(self, num_blocks: int) -> tuple[int, int, int, int]:
        return (num_blocks, self.block_size, self.num_kv_heads, self.head_dim)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_compatible(self, sender: KVLayout) -> None:
        """Raise LayoutMismatch unless blocks from ``sender`` can land in this (receiver's) cache."""
        for name in ("num_layers", "num_kv_heads", "head_dim", "block_size"):
            mine, theirs = getattr(self, name), getattr(sender, name)
            if mine != theirs:
                raise LayoutMismatch(f"{name} differs: sender has {theirs}, receiver has {mine}")
        if self.model_fingerprint != sender.model_fingerprint:
            raise LayoutMismatch(f"model fingerprint differs: sender {sender.model_fingerprint!r}, "
                                 f"receiver {self.model_fingerprint!r} (different weights or config)")

    def to_proto(self) -> pb.KVLayout:
        return pb.KVLayout(num_layers=self.num_layers, num_kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                           block_size=self.block_size,
                           layer_codecs=[int(get_codec(c).codec_id) for c in self.layer_codecs],  # type: ignore[misc]  # ints are values of the proto Codec enum
                           model_fingerprint=self.model_fingerprint, cache_dtype=CACHE_DTYPES[self.cache_dtype])

    @classmethod
    def from_proto(cls, msg: pb.KVLayout) -> KVLayout:
        try:
            codecs = tuple(get_codec_by_id(c).name for c in msg.layer_codecs)
        except CodecError as exc:
            raise LayoutMismatch(f"layout: {exc}") from None
        if msg.cache_dtype not in _DTYPE_NAMES:
            raise LayoutMismatch(f"layout: unknown cache dtype id {msg.cache_dtype}")
        return cls(msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.block_size, codecs,
                   msg.model_fingerprint, _DTYPE_NAMES[msg.cache_dtype])
