"""The colocated worker: encode, prefill and decode in one engine, the way aggregated serving runs.

This is the baseline that disaggregation is measured against (``epd serve --mode colocated``,
``epd bench compare``). It sits in the decode pool and speaks the DecodeWorker service, so the
registry, routing, status, drain and scaling treat it like any decode replica; only its request
path differs:

  Complete   the prompt is checked, images are encoded here with the model's own vision tower,
             and the request joins the engine's running batch (chunked prefill mixed with decode,
             continuous batching). Tokens stream back as the engine makes them. A client that goes
             away aborts the request and frees its blocks.

Reserve/Generate (the disaggregated KV push) are refused with FAILED_PRECONDITION: no prefill
worker may push into a colocated worker's cache.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import torch

from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from workers.engine_loop import EngineLoop
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import EngineError, InvalidRequestError
from workers.runtime.loader import LoadedModel
from workers.runtime.sequence import MultimodalInput
from workers.runtime.vision import encode_images, preprocess_images
from workers.service_base import (
    Drainable,
    WorkerIdentity,
    abort_for,
    keepalive_of,
    request_id_of,
    sampling_from_proto,
    stream_tokens,
    timeout_of,
)


class ColocatedService(Drainable, wgrpc.DecodeWorkerServicer):
    def __init__(self, bundle: LoadedModel, config: EngineConfig, identity: WorkerIdentity | None = None) -> None:
        self.identity = identity or WorkerIdentity("decode")
        self.bundle = bundle
        self.engine = Engine(bundle.model, bundle.tokenizer, config, bundle.eos_token_ids)
        if config.warmup:
            self.engine.warm_up()
        self.loop = EngineLoop(self.engine, name="colocated-loop")
        self._vision_lock = threading.Lock()  # the vision tower runs one batch at a time

    def handlers(self) -> tuple[list, list]:
        return [(wgrpc.add_DecodeWorkerServicer_to_server, self)], []

    def close(self) -> None:
        self.loop.stop()

    # ------------------------------------------------------------------ RPCs
    def Complete(self, request: wpb.CompleteRequest, context: grpc.ServicerContext) -> Iterator[wpb.TokenChunk]:
        self.refuse_if_draining(context)
        prompt = list(request.prompt_token_ids)
        try:
            rid = request_id_of(request)
            timeout_of(request)  # the caller's gRPC deadline bounds the call; a bad value is still refused
            keepalive = keepalive_of(request)
            params = sampling_from_proto(request.params)
            self.engine.check_request(prompt, params)  # cheap checks before the vision tower runs
            mm = self._embed(list(request.images), tuple(request.image_positions))
            if mm is not None:
                self.engine.check_request(prompt, params, mm)
            q = self.loop.submit(rid, prompt, params, mm)
        except EngineError as exc:
            abort_for(context, exc)
        yield from stream_tokens(self.loop, rid, q, len(prompt), context, whole=True, keepalive_s=keepalive)

    def _embed(self, images: list[bytes], positions: tuple[int, ...]) -> MultimodalInput | None:
        if not images:
            if positions:
                raise InvalidRequestError("image_positions given without images")
            return None
        vision = self.bundle.vision
        if vision is None:
            raise InvalidRequestError("this model does not accept images")
        rows = len(images) * vision.config.num_image_tokens
        if len(positions) != rows:  # the engine checks the positions against the prompt
            raise InvalidRequestError(f"{len(images)} image(s) need {rows} placeholder positions, got {len(positions)}")
        pixels = list(preprocess_images(images, vision.config).values())  # InvalidImageError names the image
        with self._vision_lock:
            embeds = encode_images(vision, pixels)
        return MultimodalInput(torch.cat(embeds).to(torch.float32), positions)

    def Reserve(self, request: wpb.ReserveRequest, context: grpc.ServicerContext) -> wpb.ReserveReply:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      "this is a colocated worker: it takes whole requests (Complete), not KV pushes")

    def Generate(self, request: wpb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[wpb.TokenChunk]:
        context.abort(grpc.StatusCode.FAILED_PRECONDITION,
                      "this is a colocated worker: it takes whole requests (Complete), not KV pushes")

    def Abort(self, request: wpb.AbortRequest, context: grpc.ServicerContext) -> wpb.AbortReply:
        return wpb.AbortReply(found=self.loop.abort(request.request_id))

    def Status(self, request: wpb.StatusRequest, context: grpc.ServicerContext) -> wpb.WorkerStatus:
        s = self.engine.stats()
        return wpb.WorkerStatus(worker_id=self.identity.worker_id, pool="decode", address=self.identity.address,
                                draining=self.identity.draining, running=s.num_running, waiting=s.num_waiting,
                                kv_blocks_total=s.blocks_total, kv_blocks_free=s.blocks_free,
                                reservations=s.num_reservations, preemptions=s.num_preemptions,
                                prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
                                model_fingerprint=self.engine.model.fingerprint())

