"""The prefill worker: computes prompts and streams their KV to the decode worker that reserved it.

A request's life here:
  1. Prefill   (with images) waits for the encode worker's embeddings, pushed to this worker's
               PushEmbeddings service; asks the decode worker named in the request whether it holds
               the reservation (``Holds``: refused before any compute when not); then opens the KV stream
               to the decode worker named in the request, queues the prompt, and streams each layer's
               blocks as prefill computes them.
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
from kvtransfer.codecs import Kind, get_codec
from kvtransfer.embeddings import EmbeddingOutcome, EmbeddingReceiver, embedding_handler
from kvtransfer.errors import TransferFailed, fresh
from kvtransfer.layout import KVLayout
from kvtransfer.sender import KVSender
from kvtransfer.stream import PushResult
from workers.engine_loop import EngineLoop, LoopFailure
from workers.prefill.kv_stream import LayerStreamer
from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import EngineError, InvalidRequestError
from workers.runtime.loader import LoadedModel
from workers.runtime.sampler import SamplingParams
from workers.runtime.sequence import MultimodalInput
from workers.service_base import (
    Drainable,
    WorkerIdentity,
    abort_for,
    first_logprobs,
    logprobs_to_proto,
    request_id_of,
    sampling_from_proto,
    timeout_of,
)
from workers.tracing import child_span, end_child, mark_kv_failure


class PrefillService(Drainable, wgrpc.PrefillWorkerServicer):
    def __init__(self, bundle: LoadedModel, config: EngineConfig, codecs: tuple[str, ...], sender: KVSender,
                 identity: WorkerIdentity | None = None) -> None:
        self.identity = identity or WorkerIdentity("prefill")
        self.engine = Engine(bundle.model, bundle.tokenizer, config, bundle.eos_token_ids)
        if config.warmup:
            self.engine.warm_up()
        self.loop = EngineLoop(self.engine, name="prefill-loop")
        self.sender = sender
        self.streamer = LayerStreamer(self.engine, sender, codecs)
        fingerprint = bundle.vision.fingerprint() if bundle.vision is not None else "no-vision"
        self.embeddings = EmbeddingReceiver(bundle.config.hidden_size, fingerprint)
        self.embeddings.expectations.start_janitor()
        self._inflight: set[str] = set()  # request ids with a Prefill call in progress
        self._inflight_lock = threading.Lock()

    def handlers(self) -> tuple[list, list]:
        return [(wgrpc.add_PrefillWorkerServicer_to_server, self)], [embedding_handler(self.embeddings)]

    def close(self) -> None:
        self.embeddings.expectations.stop()
        self.loop.stop()
        self.streamer.close()
        self.sender.close()

    def Prefill(self, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillReply:
        self.refuse_if_draining(context)
        prompt = list(request.prompt_token_ids)
        try:
            rid, timeout = request_id_of(request), timeout_of(request)
            params = sampling_from_proto(request.params)
            # prefill samples only the first token; the rest of the rules apply on the decode worker
            first_params = dataclasses.replace(params, max_tokens=1, stop=(), stop_token_ids=(), ignore_eos=True)
            self.engine.check_request(prompt, first_params)
            positions = len(request.image_positions)
            if request.num_image_embeddings != positions or positions > len(prompt):
                raise InvalidRequestError(f"num_image_embeddings ({request.num_image_embeddings}) must equal the "
                                          f"number of image_positions ({positions}), at most one per "
                                          f"prompt token ({len(prompt)})")
            if not request.complete and not request.kv_target:
                raise InvalidRequestError("kv_target (the decode worker that reserved the KV) is required")
        except EngineError as exc:
            abort_for(context, exc)
        with self._inflight_lock:  # a second call with a live request's id must not touch the first
            duplicate = rid in self._inflight
            self._inflight.add(rid)
        if duplicate:
            context.abort(grpc.StatusCode.ALREADY_EXISTS, f"request {rid!r} is already being prefilled on this worker")
        finished = threading.Event()
        # from here on, a caller that goes away (or its deadline) aborts the request wherever it is: waiting
        # for embeddings, queued, computing or streaming its KV
        context.add_callback(lambda: None if finished.is_set() else self._abort(rid, "the caller went away"))
        # (a caller gone before that is seen where the request would wait for it: _await_embeddings)
        try:
            return self._prefill(rid, prompt, params, first_params, timeout, request, context)
        finally:
            finished.set()
            with self._inflight_lock:
                self._inflight.discard(rid)

    def _prefill(self, rid: str, prompt: list[int], params: SamplingParams, first_params: SamplingParams,
                 timeout: float, request: wpb.PrefillRequest, context: grpc.ServicerContext) -> wpb.PrefillReply:
        mm = None
        if request.num_image_embeddings:
            waited = child_span("wait-embeddings", {"epd.image_embeddings": request.num_image_embeddings})
            try:
                mm = self._await_embeddings(rid, request, timeout, context)
            finally:
                end_child(waited)
        if request.complete:
            return self._complete(rid, prompt, params, mm, timeout, context)
        kv_span = child_span("kv-transfer", {"epd.kv.target": request.kv_target, "epd.prompt_tokens": len(prompt),
                                             "epd.kv.codec": ",".join(sorted(set(self.streamer.layout.layer_codecs))),
                                             "epd.kv.layers": self.streamer.layout.num_layers})
        kv_error: str | None = "did not finish"
        from_loop = False  # a LoopFailure is the engine's, not the transfer's
        try:
            cached = self._check_reservation(rid, request.kv_target, len(prompt), timeout)
            self.streamer.start(rid, request.kv_target, len(prompt), timeout, cached)
            q = self.loop.submit(rid, prompt, first_params, mm)
            self._abort_if_gone(rid, context)
            item = q.get(timeout=timeout)
            if isinstance(item, LoopFailure):
                from_loop = True
                if item.error is not None:
                    raise item.error
                raise TransferFailed(item.message, grpc.StatusCode.INTERNAL)
            if not item.new_token_ids:  # aborted (the Abort RPC) before its first token
                failed = self.streamer.failed(rid)
                from_loop = failed is None
                raise (fresh(failed) if failed else
                       TransferFailed(f"prefill of {rid!r} was aborted", grpc.StatusCode.CANCELLED))
            push = self.streamer.finish(rid, item.new_token_ids[0], first_logprobs(item.logprobs))
            kv_error = None
        except EngineError as exc:
            item = failed = None  # this frame is in exc's traceback: holding exc too would make a cycle
            self._abort(rid, str(exc))
            kv_error = str(exc)
            abort_for(context, exc)
        except TransferFailed as exc:
            item = failed = None  # as above
            self._abort(rid, exc.message)
            kv_error = exc.message
            if not from_loop:
                mark_kv_failure(context)
            context.abort(exc.code or grpc.StatusCode.UNAVAILABLE, exc.message)
        except queue.Empty:
            self._abort(rid, "prefill timed out")
            kv_error = "prefill timed out"
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid!r} did not finish in {timeout} s")
        except Exception as exc:  # a bug: never leave the stream open
            self._abort(rid, f"prefill failed: {type(exc).__name__}: {exc}")
            kv_error = f"prefill failed: {type(exc).__name__}: {exc}"
            context.abort(grpc.StatusCode.INTERNAL, f"prefill of {rid!r} failed: {type(exc).__name__}: "
                                                    f"{str(exc)[:200]}")
        finally:
            if kv_error is None:
                end_child(kv_span, None, {"epd.kv.wire_bytes": push.num_bytes,
                                          "epd.kv.logical_bytes": push.logical_bytes,
                                          "epd.kv.transport": push.transport, "epd.kv.chunks": push.num_chunks})
            else:
                end_child(kv_span, kv_error)
        reply = wpb.PrefillReply(first_token=item.new_token_ids[0], kv_bytes=push.num_bytes,
                                 kv_logical_bytes=push.logical_bytes, transport=push.transport,
                                 kv_seconds=push.seconds, kv_layers=self.streamer.layout.num_layers,
                                 kv_codecs=kv_codec_stats(self.streamer.layout, len(prompt), push))
        if item.logprobs is not None:
            reply.first_logprobs.CopyFrom(logprobs_to_proto(item.logprobs))
        if item.prompt_logprobs:
            reply.prompt_logprobs.extend(logprobs_to_proto(t) for t in item.prompt_logprobs)
        return reply

    def _check_reservation(self, rid: str, target: str, num_tokens: int, timeout: float) -> int:
        """The KV handshake first: TransferFailed before any compute when ``target`` holds no reservation
        for ``rid`` (or cannot be asked). Returns how many of its first blocks ``target`` holds already (its
        prefix cache): the push skips them."""
        stub = wgrpc.DecodeWorkerStub(self.sender.channel(target))
        try:
            reply = stub.Holds(wpb.HoldsRequest(request_id=rid, num_tokens=num_tokens, skips_cached_blocks=True),
                               metadata=self.sender.security.call_metadata(), timeout=min(timeout, 10.0))
        except grpc.RpcError as exc:
            raise TransferFailed(f"cannot ask decode worker {target} for the reservation of {rid!r}: "
                                 f"{exc.details() or exc.code().name}", exc.code()) from None
        if not reply.held:
            raise TransferFailed(f"decode worker {target} holds no reservation for {rid!r}; nothing was computed",
                                 grpc.StatusCode.NOT_FOUND)
        need = self.streamer.layout.blocks_for(num_tokens)
        if reply.num_blocks != need:
            raise TransferFailed(f"{num_tokens} tokens need {need} blocks; {reply.num_blocks} are reserved for "
                                 f"{rid!r} on {target}; nothing was computed", grpc.StatusCode.OUT_OF_RANGE)
        if reply.cached_blocks >= need:
            raise TransferFailed(f"decode worker {target} says it holds {reply.cached_blocks} of {rid!r}'s {need} "
                                 f"blocks cached; at most {need - 1} can be; nothing was computed",
                                 grpc.StatusCode.OUT_OF_RANGE)
        return reply.cached_blocks

    def _complete(self, rid: str, prompt: list[int], params: SamplingParams, mm: MultimodalInput | None,
                  timeout: float, context: grpc.ServicerContext) -> wpb.PrefillReply:
        """A one-token request served here whole: no KV leaves this worker."""
        if params.max_tokens != 1:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"complete=true is for one-token requests; this one asks for {params.max_tokens}")
        try:
            q = self.loop.submit(rid, prompt, params, mm, wake=False)
            self._abort_if_gone(rid, context)
            self.loop.run_here(rid)  # an idle engine steps it on this thread: no hand-off to the loop and back
            item = q.get(timeout=timeout)
        except EngineError as exc:
            abort_for(context, exc)
        except queue.Empty:
            self._abort(rid, "prefill timed out")
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"prefill of {rid!r} did not finish in {timeout} s")
        if isinstance(item, LoopFailure):
            if item.error:
                abort_for(context, item.error, item.message)
            context.abort(grpc.StatusCode.INTERNAL, item.message)
        if not item.new_token_ids:  # aborted before its token
            context.abort(grpc.StatusCode.CANCELLED, f"prefill of {rid!r} was aborted")
        reply = wpb.PrefillReply(first_token=item.new_token_ids[0], text=item.text,
                                 finish_reason=item.finish_reason.value if item.finish_reason else "length",
                                 engine_seconds=item.engine_seconds)
        if item.logprobs is not None:
            reply.first_logprobs.CopyFrom(logprobs_to_proto(item.logprobs))
        if item.prompt_logprobs:
            reply.prompt_logprobs.extend(logprobs_to_proto(t) for t in item.prompt_logprobs)
        return reply

    def _await_embeddings(self, rid: str, request: wpb.PrefillRequest, timeout: float,
                          context: grpc.ServicerContext) -> MultimodalInput:
        done = threading.Event()
        box: list[EmbeddingOutcome] = []

        def arrived(outcome: EmbeddingOutcome) -> None:
            box.append(outcome)
            done.set()

        try:
            self.embeddings.expect(rid, request.num_image_embeddings, arrived, timeout)
        except ValueError as exc:  # the receiver's own bounds on a request
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        if not context.is_active():  # the caller left before the expectation was there for its abort to find
            self.embeddings.cancel(rid, "the caller went away")
        if not done.wait(timeout + 1.0) or not box:
            self.embeddings.cancel(rid, "prefill stopped waiting")
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"image embeddings for {rid!r} did not arrive")
        outcome = box[0]
        if not outcome.ok or outcome.embeds is None:
            context.abort(outcome.code or grpc.StatusCode.INTERNAL, f"embedding transfer failed: {outcome.error}")
        positions = tuple(request.image_positions)
        return MultimodalInput(outcome.embeds.float(), positions)

    def _abort_if_gone(self, rid: str, context: grpc.ServicerContext) -> None:
        """Abort ``rid``, just queued, if its caller went away before: the call's callback ran then and found
        nothing to abort (the KV handshake was still in progress, say), so nobody else would stop it."""
        if not context.is_active():
            self._abort(rid, "the caller went away")

    def _abort(self, rid: str, reason: str) -> None:
        self.loop.abort(rid)
        self.streamer.cancel(rid, reason)
        self.embeddings.cancel(rid, reason)

    def Abort(self, request: wpb.AbortRequest, context: grpc.ServicerContext) -> wpb.AbortReply:
        found = self.loop.abort(request.request_id)
        self.streamer.cancel(request.request_id, "aborted")
        found = self.embeddings.cancel(request.request_id, "aborted") or found
        return wpb.AbortReply(found=found)

    def Status(self, request: wpb.StatusRequest, context: grpc.ServicerContext) -> wpb.WorkerStatus:
        s = self.engine.stats()
        return wpb.WorkerStatus(worker_id=self.identity.worker_id, pool="prefill", address=self.identity.address,
                                draining=self.identity.draining, running=s.num_running, waiting=s.num_waiting,
                                kv_blocks_total=s.blocks_total, kv_blocks_free=s.blocks_free,
                                preemptions=s.num_preemptions, model_fingerprint=self.engine.model.fingerprint(),
                                prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits)


def kv_codec_stats(layout: KVLayout, num_tokens: int, push: PushResult) -> list[wpb.KVCodecStats]:
    """``push`` split by codec. Wire bytes split in proportion to each codec's encoded size of the
    request's blocks, logical bytes by layer count; the parts add up to exactly the push's totals."""
    shape = layout.block_shape(layout.blocks_for(num_tokens))
    shares: dict[str, list[int]] = {}  # codec -> [layers, encoded bytes]
    for name in layout.layer_codecs:
        codec = get_codec(name)
        share = shares.setdefault(name, [0, 0])
        share[0] += 1
        share[1] += codec.layout(shape, Kind.KEY).total_nbytes + codec.layout(shape, Kind.VALUE).total_nbytes
    total = sum(b for _, b in shares.values()) or 1
    wire_left, logical_left = push.num_bytes, push.logical_bytes
    out = []
    for i, (name, (layers, nbytes)) in enumerate(shares.items()):
        last = i == len(shares) - 1
        wire = wire_left if last else push.num_bytes * nbytes // total
        logical = logical_left if last else push.logical_bytes * layers // layout.num_layers
        wire_left -= wire
        logical_left -= logical
        out.append(wpb.KVCodecStats(codec=name, layers=layers, wire_bytes=wire, logical_bytes=logical))
    return out
