"""Streams a prefill engine's KV cache to decode workers, layer by layer, as prefill computes it.

Attach a ``LayerStreamer`` to the engine; ``start`` a stream before adding a request; the engine's
layer hook then hands each finished layer's newly completed blocks to the stream (a snapshot, so
the engine may free or reuse its blocks at once); ``finish`` sends the first token and waits for
the receiver's ack. A block is sent once it is full, or at the prompt's end; each (layer, block)
goes exactly once, except the first blocks the receiver's prefix cache holds already, which never go.
A transfer failure never breaks the engine step: the request is marked and the caller aborts it
(``failed``). ``close`` detaches the streamer and cancels the streams still open.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field

import torch

from kvtransfer.codecs.paged import QuantizedBlocks
from kvtransfer.device_chunks import CacheBlocks
from kvtransfer.errors import TransferFailed, detached, fresh
from kvtransfer.layout import KVLayout
from kvtransfer.sender import KVSender
from kvtransfer.staging import index_on
from kvtransfer.stream import KVStream, PushResult
from kvtransfer.wire import FirstLogprobs
from workers.runtime.engine import ChunkRef, Engine, LayerKVReady
from workers.runtime.kv_cache import DenseLayerStorage, QuantizedLayerStorage, block_slots


def engine_layout(engine: Engine, layer_codecs: tuple[str, ...]) -> KVLayout:
    cfg = engine.model.cfg
    dtype = engine.config.dtype if engine.config.kv_cache_dtype == "auto" else engine.config.kv_cache_dtype
    return KVLayout(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, engine.cache.block_size, layer_codecs,
                    engine.model.fingerprint(), dtype if dtype in ("float32", "bfloat16", "float16") else "float32")


@dataclass
class _Active:
    stream: KVStream
    sent: list[int]  # per layer: blocks [0, sent) are queued (or cached on the receiver)
    error: TransferFailed | None = None
    done: bool = field(default=False)


class LayerStreamer:
    """``from_cache``: hand each layer's new blocks to the stream as block indices into the paged cache
    (``KVStream.send_blocks``: encoded there by the fused kernels, no gathered copy), a quantised layer
    too; None picks it for a cache off the CPU. True on a CPU cache runs the same path with the torch
    codecs (tests)."""

    def __init__(self, engine: Engine, sender: KVSender, layer_codecs: tuple[str, ...],
                 from_cache: bool | None = None) -> None:
        self.engine = engine
        self.sender = sender
        self.layout = engine_layout(engine, layer_codecs)
        self.from_cache = engine.cache.device.type != "cpu" if from_cache is None else from_cache
        self._active: dict[str, _Active] = {}
        self._lock = threading.Lock()
        self._attached = True
        engine.add_layer_hook(self._on_layer)

    def start(self, request_id: str, target: str, num_tokens: int, timeout_s: float = 30.0,
              cached_blocks: int = 0) -> KVStream:
        """``cached_blocks``: the receiver holds the first ones already (its prefix cache): never sent."""
        stream = self.sender.open_stream(target, request_id, self.layout, num_tokens, timeout_s, cached_blocks)
        with self._lock:
            self._active[request_id] = _Active(stream, [cached_blocks] * self.layout.num_layers)
        return stream

    def failed(self, request_id: str) -> TransferFailed | None:
        act = self._active.get(request_id)
        return None if act is None else act.error or act.stream.error

    def finish(self, request_id: str, first_token: int, first_logprobs: FirstLogprobs | None = None) -> PushResult:
        with self._lock:
            act = self._active.pop(request_id)
        if act.error is not None:
            act.stream.cancel(act.error.message)
            raise fresh(act.error)  # a copy: the kept one, raised here, would hold ``act`` in a cycle
        return act.stream.finish(first_token, first_logprobs)

    def cancel(self, request_id: str, reason: str = "request aborted") -> None:
        with self._lock:
            act = self._active.pop(request_id, None)
        if act is not None:
            act.stream.cancel(reason)

    def close(self, reason: str = "the prefill worker's streamer closed") -> None:
        """Detach from the engine (its later layers reach no stream) and cancel the streams still open, with
        ``reason``. Idempotent; call it between engine steps."""
        with self._lock:
            attached, self._attached = self._attached, False
            active, self._active = self._active, {}
        if attached:
            self.engine.remove_layer_hook(self._on_layer)
        for act in active.values():
            act.stream.cancel(reason)

    def _on_layer(self, event: LayerKVReady) -> None:
        bs = self.layout.block_size
        storage = self.engine.cache.layers[event.layer]
        dtype = self.engine.model.dtype
        for chunk in event.chunks:
            act = self._active.get(chunk.request_id)
            if act is None or act.error is not None:
                continue
            lo = act.sent[event.layer]
            hi = -(-chunk.end // bs) if chunk.last else chunk.end // bs
            if hi <= lo:
                continue
            if self.from_cache and isinstance(storage, (DenseLayerStorage, QuantizedLayerStorage)):
                self._send_from_cache(act, event.layer, storage, chunk, lo, hi)
                continue
            slots = block_slots(list(chunk.blocks[lo:hi]), bs, self.engine.cache.device)
            k, v = storage.gather(slots, dtype)  # a copy: the engine may reuse the blocks after this step
            shape = (hi - lo, bs, self.layout.num_kv_heads, self.layout.head_dim)
            k, v = k.view(shape), v.view(shape)
            tail = chunk.end - (hi - 1) * bs
            if tail < bs:  # the prompt's last block is partly empty: never ship another request's stale KV
                k[-1, tail:] = 0
                v[-1, tail:] = 0
            try:
                act.stream.send_layer(event.layer, lo, k, v)
            except TransferFailed as exc:
                # kept without its traceback, whose frames (this one holds ``act``; the model's, its
                # activations) would otherwise stay alive in a cycle until a full garbage collection
                act.error = detached(exc)
                continue
            act.sent[event.layer] = hi

    def _send_from_cache(self, act: _Active, layer: int, storage: DenseLayerStorage | QuantizedLayerStorage,
                         chunk: ChunkRef, lo: int, hi: int) -> None:
        """Blocks [lo, hi) of ``chunk``'s request, encoded straight from the layer's cache by index (a
        quantised layer as codes and scales, read as the engine's gather would dequantise them)."""
        bs, h, d = self.layout.block_size, self.layout.num_kv_heads, self.layout.head_dim
        k_cache, v_cache = storage.k.view(-1, bs, h, d), storage.v.view(-1, bs, h, d)
        scales = ((storage.k_scale.view(-1, bs, h), storage.v_scale.view(-1, bs, h))
                  if isinstance(storage, QuantizedLayerStorage) else ())
        tail = chunk.end - (hi - 1) * bs
        if tail < bs:  # the prompt's last block is partly empty: zero its unused slots (this request's own,
            last = chunk.blocks[hi - 1]  # never written before its next token) so no stale KV is shipped
            for part in (k_cache, v_cache, *scales):
                part.view(torch.uint8)[last, tail:] = 0  # bytes: CPU cannot fill float8; 0 is +0.0 in every dtype
        k: CacheBlocks = k_cache
        v: CacheBlocks = v_cache
        if scales:
            k = QuantizedBlocks(k_cache, scales[0], self.engine.model.dtype)
            v = QuantizedBlocks(v_cache, scales[1], self.engine.model.dtype)
        ids = index_on(k_cache.device, list(chunk.blocks[lo:hi]))  # no wait for the GPU inside the hook
        try:
            act.stream.send_blocks(layer, lo, k, v, ids)
        except TransferFailed as exc:
            act.error = detached(exc)  # as in _on_layer
            return
        act.sent[layer] = hi
