"""The decode worker: holds blocks for prompts whose KV prefill workers push, then decodes.

A request's life here:
  1. Reserve   the prompt is checked and blocks are held; the KV receiver expects exactly one push
               into them before the deadline. ``Holds`` tells a prefill worker, before it computes,
               whether that reservation exists. Refused with RESOURCE_EXHAUSTED when the pool is full now,
               INVALID_ARGUMENT when the request could never fit in it.
  2. (push)    a prefill worker streams the KV into the blocks (kvtransfer.receiver).
  3. Generate  waits for the push, joins the sequence to the running batch with prefill's first
               token, and streams tokens until it finishes. A failed push ends the stream with the
               transfer's status; a client that goes away aborts the request.
  Blocks are released on finish, abort, a failed push, or a reservation nobody generated from: one
  whose KV landed (or failed) with no Generate for it within ``UNCLAIMED_GRACE_S`` (the dispatcher opens
  Generate right after Reserve, before prefill computes, so by then its caller is gone and its Abort was
  lost), else at twice the request's timeout.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc

from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.receiver import KVReceiver, TransferOutcome
from kvtransfer.server import kv_transfer_handler
from workers.decode.kv_sink import CacheSink, KVStore, decode_cache_dtypes
from workers.engine_loop import EngineLoop
from workers.prefill.kv_stream import engine_layout
from workers.runtime.engine import Engine, EngineConfig, KVReservation
from workers.runtime.errors import EngineError, InvalidRequestError
from workers.runtime.loader import LoadedModel
from workers.runtime.sampler import SamplingParams
from workers.service_base import (
    Drainable,
    WorkerIdentity,
    abort_for,
    keepalive_of,
    logprobs_of_first,
    request_id_of,
    sampling_from_proto,
    stream_tokens,
    timeout_of,
)
from workers.tracing import mark_kv_failure

log = logging.getLogger(__name__)

UNCLAIMED_GRACE_S = 30.0


@dataclass(eq=False)
class _Pending:
    reservation: KVReservation
    prompt: list[int]
    params: SamplingParams
    deadline: float
    done: threading.Event = field(default_factory=threading.Event)
    outcome: TransferOutcome | None = None
    claimed: bool = False
    landed_at: float | None = None  # when the push ended (landed or failed), monotonic


class DecodeService(Drainable, wgrpc.DecodeWorkerServicer):
    def __init__(self, bundle: LoadedModel, config: EngineConfig, codecs: tuple[str, ...],
                 store: KVStore = "dequantize", identity: WorkerIdentity | None = None, max_streams: int = 64) -> None:
        self.identity = identity or WorkerIdentity("decode")
        dtypes = decode_cache_dtypes(codecs, config.dtype, store)
        self.engine = Engine(bundle.model, bundle.tokenizer,
                             EngineConfig(**{**config.__dict__, "kv_layer_dtypes": dtypes}), bundle.eos_token_ids)
        if config.warmup:
            self.engine.warm_up()
        self.loop = EngineLoop(self.engine, name="decode-loop")
        self.receiver = KVReceiver(engine_layout(self.engine, codecs), CacheSink(self.engine.cache),
                                   max_streams=max_streams)
        self.receiver.start_janitor()
        self._pending: dict[str, _Pending] = {}
        self.unclaimed_grace_s = UNCLAIMED_GRACE_S
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._janitor = threading.Thread(target=self._sweep_loop, name="decode-janitor", daemon=True)
        self._janitor.start()

    def handlers(self) -> tuple[list, list]:
        return [(wgrpc.add_DecodeWorkerServicer_to_server, self)], [kv_transfer_handler(self.receiver)]

    def close(self) -> None:
        self._stop.set()
        self.receiver.stop()
        self.loop.stop()

    # ------------------------------------------------------------------ RPCs
    def Reserve(self, request: wpb.ReserveRequest, context: grpc.ServicerContext) -> wpb.ReserveReply:
        self.refuse_if_draining(context)
        prompt = list(request.prompt_token_ids)
        try:
            rid, timeout = request_id_of(request), timeout_of(request)
            params = sampling_from_proto(request.params)
            self.engine.check_request(prompt, params)
            positions = list(request.image_positions)
            if positions != sorted(set(positions)) or (positions and positions[-1] >= len(prompt)):
                raise InvalidRequestError("image_positions must be distinct, ascending and inside the prompt "
                                          f"({len(prompt)} tokens)")
            reservation = self.engine.reserve(rid, len(prompt), self.engine.fit(len(prompt), params).max_tokens,
                                              positions[0] if positions else None, prompt)
        except EngineError as exc:
            abort_for(context, exc)
        pending = _Pending(reservation, prompt, params, time.monotonic() + 2 * timeout)
        with self._lock:
            self._pending[rid] = pending
        self.receiver.expect(rid, reservation.blocks, self._on_transfer, timeout, reservation.cached_blocks)
        return wpb.ReserveReply(kv_target=self.identity.address, num_blocks=len(reservation.blocks))

    def _on_transfer(self, outcome: TransferOutcome) -> None:
        with self._lock:
            pending = self._pending.get(outcome.request_id)
        if pending is None:
            return
        if not outcome.ok:
            self.engine.release(pending.reservation)
        pending.outcome = outcome
        pending.landed_at = time.monotonic()
        pending.done.set()

    def Generate(self, request: wpb.GenerateRequest, context: grpc.ServicerContext) -> Iterator[wpb.TokenChunk]:
        rid = request.request_id
        try:
            keepalive = keepalive_of(request)
        except EngineError as exc:
            abort_for(context, exc)
        with self._lock:
            pending = self._pending.get(rid)
            if pending is not None and pending.claimed:
                pending = None
            if pending is not None:
                pending.claimed = True
        if pending is None:
            context.abort(grpc.StatusCode.NOT_FOUND, f"no reservation for request {rid!r} on this worker")
        wait = context.time_remaining() if context.time_remaining() is not None else None
        arrived = pending.done.wait(min(wait, 3600.0) if wait is not None else pending.deadline - time.monotonic())
        outcome = pending.outcome
        if not arrived or outcome is None:
            self._drop(rid)
            mark_kv_failure(context)
            context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, f"the KV for {rid!r} did not arrive in time")
        with self._lock:
            self._pending.pop(rid, None)
        if not outcome.ok or outcome.first_token is None:  # a transfer that landed carries its first token
            mark_kv_failure(context)
            context.abort(outcome.code or grpc.StatusCode.INTERNAL, f"KV transfer failed: {outcome.error}")
        try:
            q = self.loop.adopt(pending.reservation, pending.prompt, outcome.first_token, pending.params,
                                logprobs_of_first(outcome.first_logprobs))
        except EngineError as exc:
            abort_for(context, exc)
        yield from stream_tokens(self.loop, rid, q, len(pending.prompt), context, keepalive_s=keepalive)

    def Holds(self, request: wpb.HoldsRequest, context: grpc.ServicerContext) -> wpb.HoldsReply:
        """Whether a reservation here still waits for the request's KV, and its blocks."""
        with self._lock:
            pending = self._pending.get(request.request_id)
        if pending is None or pending.outcome is not None or pending.deadline <= time.monotonic():
            return wpb.HoldsReply(held=False)
        if pending.reservation.cached_blocks and not request.skips_cached_blocks:
            # a prefill worker from before cached blocks: it sends every block, so none may be shared
            try:
                pending.reservation = self.engine.without_cached(
                    pending.reservation, lambda blocks: self.receiver.retarget(request.request_id, blocks))
            except EngineError as exc:  # no block free for them now (or the reservation just ended)
                log.warning("request %s: cannot take fresh blocks for an older prefill worker: %s",
                            request.request_id, exc)
                return wpb.HoldsReply(held=False)
        return wpb.HoldsReply(held=True, num_blocks=len(pending.reservation.blocks),
                              cached_blocks=pending.reservation.cached_blocks)

    def Abort(self, request: wpb.AbortRequest, context: grpc.ServicerContext) -> wpb.AbortReply:
        rid = request.request_id
        found = self._drop(rid)
        found = self.loop.abort(rid) or found
        return wpb.AbortReply(found=found)

    def Status(self, request: wpb.StatusRequest, context: grpc.ServicerContext) -> wpb.WorkerStatus:
        s = self.engine.stats()
        return wpb.WorkerStatus(worker_id=self.identity.worker_id, pool="decode", address=self.identity.address,
                                draining=self.identity.draining, running=s.num_running, waiting=s.num_waiting,
                                kv_blocks_total=s.blocks_total, kv_blocks_free=s.blocks_free,
                                reservations=s.num_reservations, preemptions=s.num_preemptions,
                                prefix_cache_queries=s.prefix_cache_queries, prefix_cache_hits=s.prefix_cache_hits,
                                model_fingerprint=self.engine.model.fingerprint())

    # ------------------------------------------------------------------ cleanup
    def _drop(self, rid: str) -> bool:
        """Forget a reservation that will not be generated from, releasing its blocks."""
        with self._lock:
            pending = self._pending.pop(rid, None)
        if pending is None:
            return False
        self._release(rid, pending)
        return True

    def _release(self, rid: str, pending: _Pending) -> None:
        """Release a reservation already taken out of ``_pending`` (so no Generate can claim it now)."""
        self.receiver.cancel(rid, "request aborted")
        self.engine.release(pending.reservation)
        if pending.outcome is None:  # wake a Generate waiting for this KV
            pending.outcome = TransferOutcome(rid, False, code=grpc.StatusCode.CANCELLED, error="request aborted")
        pending.done.set()

    def _sweep_loop(self) -> None:
        while not self._stop.wait(0.25):
            now = time.monotonic()
            with self._lock:  # taken out under the lock Generate claims under: a claim and a sweep never cross
                stale = [(rid, self._pending.pop(rid)) for rid, p in list(self._pending.items()) if not p.claimed and (
                    p.deadline <= now or (p.landed_at is not None and now - p.landed_at > self.unclaimed_grace_s))]
            for rid, pending in stale:  # transferred (or failed) but nobody came to generate
                self._release(rid, pending)
