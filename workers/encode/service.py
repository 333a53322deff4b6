"""The encode worker: images to embeddings, pushed to the prefill worker that will use them.

Embeddings are cached by the image bytes' SHA-256, so a repeated image (a chat's every turn resends it)
costs a lookup: an LRU bounded in bytes (``cache_bytes``; one LLaVA-1.5 image is 576 x 4096 float32 values,
9 MiB), held in host memory whatever the encoder's device (the push sends from host memory anyway).

The push retries briefly while the prefill worker has not yet registered the request (the control plane
starts both calls at once). A caller that goes away (its client left, or another stage of the request
failed, and the control plane cancelled the call; or its deadline passed) is seen before the encoder runs,
before the push and between the push's retries: the call then ends there, CANCELLED, rather than retrying a
push that no prefill worker will take until its deadline.
"""

from __future__ import annotations

import hashlib
import threading
import time
from collections import OrderedDict

import grpc
import torch

from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import ChannelCache, TransferSecurity
from kvtransfer.embeddings import push_embeddings
from kvtransfer.errors import TransferFailed
from workers.runtime.errors import EngineError
from workers.runtime.vision import VisionEncoder, encode_images, preprocess_images
from workers.service_base import Drainable, WorkerIdentity, request_id_of, status_code_for, timeout_of
from workers.tracing import current_span

DEFAULT_CACHE_BYTES = 1 << 30


class EncodeService(Drainable, wgrpc.EncodeWorkerServicer):
    def __init__(self, encoder: VisionEncoder, security: TransferSecurity, identity: WorkerIdentity | None = None,
                 cache_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        """``cache_bytes``: the embedding cache's bound (0: no cache)."""
        self.identity = identity or WorkerIdentity("encode")
        self.encoder = encoder
        self.security = security
        self.cache_bytes = cache_bytes
        self._cache: OrderedDict[str, torch.Tensor] = OrderedDict()  # least recently used first
        self._cached_bytes = 0
        self._lock = threading.Lock()
        self._channels = ChannelCache(security)
        self.encoded = 0
        self._running = 0  # Encode calls in progress: Status's ``running``, which a drain waits on

    def handlers(self) -> tuple[list, list]:
        return [(wgrpc.add_EncodeWorkerServicer_to_server, self)], []

    def close(self) -> None:
        self._channels.close()

    def embed(self, images: list[bytes]) -> tuple[torch.Tensor, int]:
        """Embeddings for ``images`` in order, [rows, hidden]; and how many came from the cache."""
        keys = [hashlib.sha256(data).hexdigest() for data in images]
        with self._lock:
            cached = {k: self._cache[k] for k in keys if k in self._cache}
            for k in cached:
                self._cache.move_to_end(k)  # used now: the last to go
        todo = [k for k in keys if k not in cached]
        if todo:
            hits = {i for i, k in enumerate(keys) if k in cached}
            pixels = preprocess_images(images, self.encoder.config, skip=hits)  # an error names the image
            for i, emb in zip(pixels, encode_images(self.encoder, list(pixels.values()))):
                cached[keys[i]] = emb.to(device="cpu", dtype=torch.float32).contiguous()
            self._keep({k: cached[k] for k in todo})
        return torch.cat([cached[k] for k in keys]), len(images) - len(todo)

    def _keep(self, new: dict[str, torch.Tensor]) -> None:
        """Cache ``new`` as the most recently used, then drop the least recently used past ``cache_bytes``
        (one embedding larger than the whole bound is not kept)."""
        with self._lock:
            for k, emb in new.items():
                if emb.nbytes > self.cache_bytes:
                    continue
                old = self._cache.pop(k, None)
                self._cached_bytes += emb.nbytes - (old.nbytes if old is not None else 0)
                self._cache[k] = emb
            while self._cached_bytes > self.cache_bytes:
                _, dropped = self._cache.popitem(last=False)
                self._cached_bytes -= dropped.nbytes

    @property
    def cached(self) -> tuple[int, int]:
        """(embeddings, bytes) in the cache."""
        with self._lock:
            return len(self._cache), self._cached_bytes

    def Encode(self, request: wpb.EncodeRequest, context: grpc.ServicerContext) -> wpb.EncodeReply:
        with self._lock:  # counted before the drain check: a drain never sees 0 while a call gets past it
            self._running += 1
        try:
            self.refuse_if_draining(context)
            return self._encode(request, context)
        finally:
            with self._lock:
                self._running -= 1

    def _encode(self, request: wpb.EncodeRequest, context: grpc.ServicerContext) -> wpb.EncodeReply:
        if not request.images:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no images to encode")
        if not request.embeddings_target:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "embeddings_target (the prefill worker) is required")
        try:
            rid, timeout = request_id_of(request), timeout_of(request)
            self._stop_if_gone(context)
            embeds, hits = self.embed(list(request.images))
        except EngineError as exc:
            context.abort(status_code_for(exc), str(exc))
        deadline = time.monotonic() + timeout
        channel = self._channels.get(request.embeddings_target)
        while True:
            self._stop_if_gone(context)
            try:
                push_embeddings(channel, self.security, rid, embeds, self.encoder.fingerprint(),
                                timeout_s=max(0.1, deadline - time.monotonic()))
                break
            except TransferFailed as exc:
                if exc.code == grpc.StatusCode.NOT_FOUND and time.monotonic() < deadline - 0.05:
                    time.sleep(0.01)  # the prefill worker has not registered the request yet
                    continue
                context.abort(exc.code or grpc.StatusCode.UNAVAILABLE, exc.message)
        self.encoded += len(request.images)
        span = current_span()  # the Encode server span when the call is traced; a no-op otherwise
        span.set_attribute("epd.images", len(request.images))
        span.set_attribute("epd.encoder.cache_hits", hits)
        span.set_attribute("epd.embeddings", int(embeds.shape[0]))
        return wpb.EncodeReply(num_embeddings=embeds.shape[0], cache_hits=hits)

    @staticmethod
    def _stop_if_gone(context: grpc.ServicerContext) -> None:
        """End the call (CANCELLED) when its caller is gone: nobody will read the embeddings."""
        if not context.is_active():
            context.abort(grpc.StatusCode.CANCELLED, "the caller went away (cancelled, or past its deadline)")

    def Status(self, request: wpb.StatusRequest, context: grpc.ServicerContext) -> wpb.WorkerStatus:
        return wpb.WorkerStatus(worker_id=self.identity.worker_id, pool="encode", address=self.identity.address,
                                draining=self.identity.draining, running=self._running,
                                model_fingerprint=self.encoder.fingerprint())

