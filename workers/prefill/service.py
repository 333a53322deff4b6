"""The prefill worker: computes prompts and streams their KV to the decode worker that reserved it.

A request's life here:
  1. Prefill   (with images) waits for the encode worker's embeddings, pushed to this worker's
               PushEmbeddings service; then opens the KV stream to the decode worker named in the
               request, queues the prompt, and streams each layer's blocks as prefill computes them.
  2. reply     the first token, once the decode worker acknowledged every block.
  A refused or broken transfer, a timeout or a client that goes away aborts the prompt and the
  stream; the decode worker then releases its reservation.
"""

from __future__ import annotations

import dataclasses
import queue
import threading

import grpc

from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.embeddings import EmbeddingOutcome, EmbeddingReceiver, embedding_handler
from kvtransfer.errors import TransferFailed
from kvtransfer.sender import KVSender
from workers.engine_loop import EngineLoop, LoopFailure
from workers.prefill.kv_stream import LayerStreamer
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import EngineError
from workers.runtime.loader import LoadedModel
from workers.runtime.sequence import MultimodalInput
from workers.service_base import WorkerIdentity, sampling_from_proto, status_code_for


class PrefillService(wgrpc.PrefillWorkerServicer):
    def __init__(self, bundle: LoadedModel, config: EngineConfig, codecs: tuple[str, ...], sender: KVSender,
                 identity: WorkerIdentity | None = None) -> None:
        self.identity = identity or WorkerIdentity("prefill")
        self.engine = Engine(bundle.model, bundle.tokenizer, config, bundle.eos_token_ids)
        self.loop = EngineLoop(self.engine, name="prefill-loop")
        self.sender = sender
        self.streamer = LayerStreamer(self.engine, sender, codecs)
        fingerprint = bundle.vision.fingerprint() if bundle.vision is not None else "no-vision"
        self.embeddings = EmbeddingReceiver(bundle.config.hidden_size, fingerprint)
        self.embeddings.expectations.start_janitor()

    def handlers(self) -> tuple[list, list]:
        return [(wgrpc.add_PrefillWorkerServicer_to_server, self)], [embedding_handler(self.embeddings)]

    def close(self) -> None:
        self.embeddings.expectations.stop()
        self.loop.stop()
        self.sender.close()

    def Prefill(self, request: "wpb.PrefillRequest", context: grpc.ServicerContext) -> "wpb.PrefillReply":
        if self.identity.draining:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"prefill worker {self.identity.worker_id} is draining")
        rid, prompt = request.request_id, list(request.prompt_token_ids)
        timeout = request.timeout_s or 30.0
        try:
            params = sampling_from_proto(request.params)
            # prefill samples only the first token; the rest of the rules apply on the decode worker
            first_params = dataclasses.replace(params, max_tokens=1, stop=(), stop_token_ids=(), ignore_eos=True)
            self.engine.check_request(prompt, first_params)
        except EngineError as exc:
            context.abort(status_code_for(exc), str(exc))
        mm = None
        if request.num_image_embeddings:
            mm = self._await_embeddings(rid, request, timeout, context)
        finished = threading.Event()
        context.add_callback(lambda: None if finished.is_set() else self._abort(rid, "the caller went away"))
        try:
            self.streamer.start(rid, request.kv_target, len(prompt), timeout)
            q = self.loop.submit(rid, prompt, first_params, mm)
            item = q.get(timeout=timeout)
            if isinstance(item, LoopFailure):
                raise TransferFailed(item.message, grpc.StatusCode.INTERNAL)
            push = self.streamer.finish(rid, item.new_token_ids[0])
        except EngineError as exc:
            self._abort(rid, str(exc))
            context.abort(status_code_for(exc), str(exc))
        except TransferFailed as exc:
            self._abort(rid, exc.message)
            context.abort(exc.code or grpc.StatusCode.UNAVAILABLE, exc.message)
        except queue.Empty:
            self._abort(rid, "prefill timed out")
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid!r} did not finish in {timeout} s")
        except Exception as exc:  # a bug: never leave the stream open
            self._abort(rid, f"prefill failed: {type(exc).__name__}")
            context.abort(grpc.StatusCode.INTERNAL, f"prefill of {rid!r} failed: {type(exc).__name__}")
        finally:
            finished.set()
        return wpb.PrefillReply(first_token=item.new_token_ids[0], kv_bytes=push.num_bytes,
                                kv_logical_bytes=push.logical_bytes, transport=push.transport)

    def _await_embeddings(self, rid: str, request: "wpb.PrefillRequest", timeout: float,
                          context: grpc.ServicerContext) -> MultimodalInput:
        done = threading.Event()
        box: list[EmbeddingOutcome] = []
        self.embeddings.expect(rid, request.num_image_embeddings, lambda o: (box.append(o), done.set()), timeout)
        if not done.wait(timeout + 1.0) or not box:
            self.embeddings.cancel(rid, "prefill stopped waiting")
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"image embeddings for {rid!r} did not arrive")
        outcome = box[0]
        if not outcome.ok:
            context.abort(outcome.code or grpc.StatusCode.INTERNAL, f"embedding transfer failed: {outcome.error}")
        positions = tuple(request.image_positions)
        return MultimodalInput(outcome.embeds.float(), positions)

    def _abort(self, rid: str, reason: str) -> None:
        self.loop.abort(rid)
        self.streamer.cancel(rid, reason)
        self.embeddings.cancel(rid, reason)

    def Abort(self, request: "wpb.AbortRequest", context: grpc.ServicerContext) -> "wpb.AbortReply":
        found = self.loop.abort(request.request_id)
        self.streamer.cancel(request.request_id, "aborted")
        found = self.embeddings.cancel(request.request_id, "aborted") or found
        return wpb.AbortReply(found=found)

    def Status(self, request: "wpb.StatusRequest", context: grpc.ServicerContext) -> "wpb.WorkerStatus":
        s = self.engine.stats()
        return wpb.WorkerStatus(worker_id=self.identity.worker_id, pool="prefill", address=self.identity.address,
                                draining=self.identity.draining, running=s.num_running, waiting=s.num_waiting,
                                kv_blocks_total=s.blocks_total, kv_blocks_free=s.blocks_free,
                                model_fingerprint=self.engine.model.fingerprint())

    def Drain(self, request: "wpb.DrainRequest", context: grpc.ServicerContext) -> "wpb.WorkerStatus":
        self.identity.draining = True
        return self.Status(wpb.StatusRequest(), context)
