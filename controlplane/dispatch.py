"""Drives one request through the workers the scheduler picked, over their gRPC services.

  1. Reserve on the decode worker (refused at once when its pool is full).
  2. Encode (images only) and Prefill run at once; prefill waits for the embeddings, then streams
     the KV to the decode worker.
  3. Generate on the decode worker streams the tokens back.
A one-token request (max_tokens 1) is done after prefill: Prefill(complete=true) samples its token under
the request's own rules, and no decode worker or KV transfer is involved.
A colocated route (``epd serve --mode colocated``) is one call instead: Complete on a worker that
encodes, prefills and decodes the request in one engine.
Any failure aborts the request on every worker it touched, so nothing keeps blocks for it.

Calls in flight to one worker are capped (``max_calls_per_worker``, the worker server's stream budget:
``transfer.max_streams``). A request that finds a worker at its cap fails at once with stage "busy" and
RESOURCE_EXHAUSTED, before any call, and the scheduler retries it from its bounded queue (then 429).
Without the cap, a burst past the server's HTTP/2 stream limit came back as RST_STREAM REFUSED_STREAM:
a 502 for requests that never ran.

A worker is *lost* to a request when its call broke under it (UNAVAILABLE or UNKNOWN without the
worker's own KV-transfer mark: a killed process, a reset or closed socket, a missed keepalive ping) or
when its token stream stayed silent past the idle limit (``controlplane.dispatch_watch``). A failure
names its lost workers' addresses in ``DispatchError.lost``; the scheduler moves the request. A decode
worker whose stream sends only keepalives (the request waits there for KV blocks) past the request's
``max_stall_s`` is named in ``DispatchError.stalled`` instead: the request moves, the worker is not suspect.

The dispatcher keeps one channel per worker address (``controlplane.dispatch_channels``). A worker gone
for good is ``forget``-ed (the pool manager says so when it kills a replica): its channel is closed once
no call is in flight on it, so a stream still running there ends broken, as UNAVAILABLE, and migrates.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Generator, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from contextlib import ExitStack
from dataclasses import dataclass, field
from typing import Any

import grpc

from controlplane.cancellation import Cancellation, ClientGone
from controlplane.dispatch_channels import Slot, Worker, WorkerCalls, WorkerChannels
from controlplane.dispatch_watch import StreamWatch
from controlplane.observability.stages import RequestObserver, Stage
from epd.worker.v1 import worker_pb2 as wpb
from epd.worker.v1 import worker_pb2_grpc as wgrpc
from kvtransfer.auth import TransferSecurity
from kvtransfer.errors import detached
from workers.runtime.sampler import SamplingParams
from workers.service_base import MAX_TIMEOUT_S, MIN_KEEPALIVE_S, sampling_to_proto
from workers.tracing import DRAINING_REFUSAL, FAILURE_KEY


@dataclass(frozen=True)
class Route:
    decode: str
    prefill: str | None = None  # None: ``decode`` is a colocated worker that runs the whole request
    encode: str | None = None

    @property
    def colocated(self) -> bool:
        return self.prefill is None


@dataclass(frozen=True)
class WorkerRequest:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    images: tuple[bytes, ...] = ()
    image_positions: tuple[int, ...] = ()  # prompt indices of the placeholder tokens
    # The deadline of every worker call the request makes. The scheduler sets it from
    # scheduler.request_timeout_s (less the time the request queued); this default is for direct use.
    timeout_s: float = 600.0
    # Set by the ingress when the client leaves (shared by every copy of the request)
    cancel: Cancellation = field(default_factory=Cancellation, compare=False, repr=False)
    # A stream that sends only keepalive chunks this long is cancelled and its worker named ``stalled``. The
    # scheduler sets it (scheduler.max_stall_s) only when another decode replica could take the request.
    max_stall_s: float = math.inf

    @property
    def prefill_only(self) -> bool:
        """Its one token is prefill's: on a disaggregated route it needs no decode reservation."""
        return self.params.max_tokens == 1 and not self.params.forced_tokens


class DispatchError(Exception):
    """A stage failed with ``code``. ``lost``: addresses of the workers that died or hung under it.
    ``refused``: addresses of live workers that refused the call because they drain (try another).
    ``stalled``: addresses of live workers whose stream sent only keepalives for ``max_stall_s`` (the request
    waits there, preempted): move the request off, without holding it against the worker.
    ``mark``: what the worker said the call failed on (``workers.tracing``: ``EXCEEDS_CONTEXT``, ...), if it did."""

    def __init__(self, stage: str, code: grpc.StatusCode, message: str, lost: tuple[str, ...] = (),
                 refused: tuple[str, ...] = (), mark: str | None = None, stalled: tuple[str, ...] = ()) -> None:
        super().__init__(f"{stage}: {message}")
        self.stage, self.code, self.message, self.lost, self.refused = stage, code, message, lost, refused
        self.mark, self.stalled = mark, stalled


_BROKEN = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.UNKNOWN)


def _mark(exc: grpc.RpcError) -> str | None:
    """What the worker said its call failed on (``workers.tracing.mark_failure``), or None."""
    try:
        trailers: Sequence[tuple[str, Any]] = exc.trailing_metadata() or ()  # type: ignore[assignment]  # grpc's stubs type each pair as _Metadatum; at run time it is a (key, value) tuple
    except Exception:  # no trailers on a call that never reached a server
        return None
    return next((str(v) for k, v in trailers if k == FAILURE_KEY), None)


def _broke(exc: grpc.RpcError) -> bool:
    """The call broke under the worker (rather than the worker refusing it): a transport-level status,
    without the mark a worker sets on a call it ended itself (a KV transfer that failed on the other end,
    a refusal while draining)."""
    return exc.code() in _BROKEN and _mark(exc) is None


class _StageFailed(Exception):
    """An encode or prefill call failed while decode served (``error`` names that stage's worker alone)."""

    def __init__(self, error: DispatchError) -> None:
        super().__init__(str(error))
        self.error = error


def _ender(stage: Stage, cancel: Cancellation) -> Callable[[Future], None]:
    """A stage future's done callback: its end, or "cancelled" (no failure counted) when the request was."""
    return lambda f: stage.end("cancelled") if cancel.cancelled else stage.end_future(f)


def _call_until(method: Any, message: Any, metadata: tuple[tuple[str, str], ...], timeout: float,
                halt: Cancellation) -> Any:
    """``method``'s reply (a unary gRPC call), or ``grpc.FutureCancelledError`` once ``halt`` is cancelled: the
    call is then cancelled, and its worker sees its caller gone (a Prefill aborts its request wherever it is,
    an Encode stops before its push)."""
    if halt.cancelled:
        raise grpc.FutureCancelledError()
    fut = method.future(message, metadata=metadata, timeout=timeout)
    forget = halt.on_cancel(fut.cancel)
    try:
        return fut.result()
    finally:
        forget()


def _error(stage: str, exc: BaseException | None, target: str | None) -> DispatchError:
    """The stage's failure as a DispatchError; ``exc`` is a call's RpcError, or what a stage's future raised."""
    if not isinstance(exc, grpc.RpcError):  # not a call's failure: nothing says the worker was lost
        return DispatchError(stage, grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}")
    mark = _mark(exc)
    lost = (target,) if target is not None and _broke(exc) else ()
    refused = (target,) if target is not None and mark == DRAINING_REFUSAL else ()
    return DispatchError(stage, exc.code(), exc.details() or exc.code().name, lost, refused, mark)


class Dispatcher:
    def __init__(self, security: TransferSecurity, max_parallel: int = 64, max_calls_per_worker: int = 64, *,
                 keepalive_s: float = 2.0, token_idle_timeout_s: float = 5.0,
                 first_token_timeout_s: float = 60.0) -> None:
        """``token_idle_timeout_s``: a token stream silent this long (``first_token_timeout_s`` before its
        first token) is cancelled and its worker counted lost (one that sends only keepalive chunks for
        its request's ``max_stall_s``: named ``stalled``); ``keepalive_s``: the worker channels' ping."""
        self.security = security
        self.max_calls_per_worker = max_calls_per_worker
        self.token_idle_timeout_s = token_idle_timeout_s
        self.first_token_timeout_s = first_token_timeout_s
        # the workers' keepalive chunks, three to an idle limit: a preempted request that waits while its
        # engine steps is not taken for a hung worker (within what workers accept; below their floor, none)
        keepalive = min(token_idle_timeout_s / 3, MAX_TIMEOUT_S)
        self.stream_keepalive_s = keepalive if keepalive >= MIN_KEEPALIVE_S else 0.0
        self._watch = StreamWatch()
        self._channels = WorkerChannels(security, keepalive_s, max_calls_per_worker)
        self._pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="dispatch")

    def forget(self, address: str) -> None:
        """The worker at ``address`` is gone for good (killed, replaced, scaled down): its call slots and
        channel are dropped, at once when no call is in flight on it, else when its last call ends (closing
        a channel would cancel its streams, which must end broken, as UNAVAILABLE, to migrate). A call to the
        address meanwhile still works. An address the dispatcher holds nothing for: nothing to drop."""
        self._channels.forget(address)

    def serving(self, address: str) -> None:
        """A worker (re)started serving at ``address``: a channel to it is kept again, even if the address
        was forgotten before (a reused port)."""
        self._channels.serving(address)

    def held(self) -> tuple[WorkerCalls, ...]:
        """The worker addresses this dispatcher holds a channel for, with their calls in flight."""
        return self._channels.held()

    def _take(self, stack: ExitStack, target: str | None) -> Slot:
        """One call slot on ``target``, given back when ``stack`` closes (or earlier, by ``release``);
        DispatchError("busy", RESOURCE_EXHAUSTED) at once when the target is at its cap."""
        if target is None:
            return Slot(None, None)
        slot = self._channels.take(target)
        if slot is None:
            raise DispatchError("busy", grpc.StatusCode.RESOURCE_EXHAUSTED,
                                f"worker {target} already has {self.max_calls_per_worker} calls in flight")
        stack.callback(slot.release)
        return slot

    def close(self) -> None:
        self._watch.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._channels.close()

    def run(self, req: WorkerRequest, route: Route,
            on_started: Callable[[], None] = lambda: None) -> Generator[wpb.TokenChunk, None, None]:
        """The request's chunks. The workers' call slots are taken on the first ``next()`` (a busy worker
        fails it at once) and held until the generator ends or is closed. ``on_started`` is called once the
        request holds its place on the workers, before its first token: the decode worker's reservation
        made (disaggregated), its call slots taken (colocated, one-token requests)."""
        with ExitStack() as stack:
            encode = self._take(stack, route.encode if req.images else None)
            if route.colocated:
                slot = self._take(stack, route.decode)
                on_started()
                yield from self._run_colocated(req, route.decode, slot)
            elif req.prefill_only:
                prefill = self._take(stack, route.prefill)
                on_started()
                yield from self._run_prefill_only(req, route, {"prefill": prefill, "encode": encode})
            else:
                prefill = self._take(stack, route.prefill)
                decode = self._take(stack, route.decode)
                yield from self._run_disaggregated(req, route, {"prefill": prefill, "encode": encode,
                                                                "decode": decode}, on_started)

    def _run_colocated(self, req: WorkerRequest, target: str, slot: Slot) -> Iterator[wpb.TokenChunk]:
        md = self.security.call_metadata()
        worker = slot.stub(wgrpc.DecodeWorkerStub)
        message = wpb.CompleteRequest(  # built before the stage begins: a stage begun is always ended
            request_id=req.request_id, prompt_token_ids=req.prompt_ids, params=sampling_to_proto(req.params),
            images=list(req.images), image_positions=list(req.image_positions), timeout_s=req.timeout_s,
            keepalive_s=self.stream_keepalive_s)
        st = RequestObserver(req.request_id).begin("complete", "decode", images=len(req.images))
        stream = worker.Complete(message, metadata=st.metadata(md), timeout=req.timeout_s)
        done = False
        try:
            for chunk in self._watched(stream, "complete", target, req.cancel, req.max_stall_s):
                done = chunk.finished
                yield chunk
        except grpc.RpcError as exc:
            if req.cancel.cancelled:  # the client left (this call was cancelled for it)
                st.end("cancelled")
                raise ClientGone("the client went away") from None
            st.end(exc)
            raise _error("complete", exc, target) from None
        finally:
            st.end(None if done else "cancelled")
            if not done:
                stream.cancel()  # the worker's callback aborts the request and frees its blocks

    def _run_prefill_only(self, req: WorkerRequest, route: Route, slots: dict[str, Slot]) -> Iterator[wpb.TokenChunk]:
        """A one-token request: its token is prefill's, so no decode reservation and no KV transfer.
        ``slots``: the prefill and encode workers' call slots."""
        assert route.prefill is not None
        md = self.security.call_metadata()
        prefill = slots["prefill"].stub(wgrpc.PrefillWorkerStub)
        message = wpb.PrefillRequest(  # built before a stage begins: a stage begun is always ended
            request_id=req.request_id, prompt_token_ids=req.prompt_ids, params=sampling_to_proto(req.params),
            num_image_embeddings=len(req.image_positions), image_positions=list(req.image_positions),
            timeout_s=req.timeout_s, complete=True)
        obs = RequestObserver(req.request_id)
        encoded: Future | None = None
        halt = Cancellation()  # the encode call's: the request cancelled, or this attempt over without it
        if req.images:
            if route.encode is None:
                raise DispatchError("route", grpc.StatusCode.FAILED_PRECONDITION, "no encode worker for images")
            encoded = self._encode(req, route, slots["encode"], obs, md, halt)
            slots["encode"].end_with(
                encoded,
                lambda f: self._abort_at(req.request_id, [(wgrpc.PrefillWorkerStub, route.prefill)])
                if f.exception() and not halt.cancelled else None)  # prefill stops waiting for embeddings
        pst = obs.begin("prefill", "prefill", prompt_tokens=len(req.prompt_ids))
        # A cancel aborts it on the worker, which ends the call. A text prompt's call blocks (its future form, which
        # could be cancelled here, costs a thread hop on every one-token request; a cancel in the moment before
        # the worker holds the request misses it, and the prefill runs to its end). An image prompt's call is
        # cancelled too: its prefill would otherwise wait for embeddings the halted encode never sends.
        at = [(wgrpc.PrefillWorkerStub, route.prefill)]
        forget = req.cancel.on_cancel(lambda: self._abort_at(req.request_id, at))
        forget_halt = req.cancel.on_cancel(halt.cancel)
        reply: wpb.PrefillReply | None = None
        try:
            if encoded is not None:
                reply = _call_until(prefill.Prefill, message, pst.metadata(md), req.timeout_s, req.cancel)
            elif not req.cancel.cancelled:  # cancelled already: not sent
                reply = prefill.Prefill(message, metadata=pst.metadata(md), timeout=req.timeout_s)
        except grpc.FutureCancelledError:
            pass  # cancelled: below
        except grpc.RpcError as exc:
            if not req.cancel.cancelled:  # else the abort ended it: below
                pst.end(exc)
                failed = encoded.exception() if encoded is not None and encoded.done() else None
                if failed is not None and not isinstance(failed, grpc.FutureCancelledError):
                    raise _error("encode", failed, route.encode) from None
                raise _error("prefill", exc, route.prefill) from None
        finally:
            forget()
            forget_halt()
            if encoded is not None and (reply is None or req.cancel.cancelled):
                halt.cancel()  # the embeddings will not be used: the encode worker stops at its next check
        if reply is None or req.cancel.cancelled:  # an answer to the abort, or one just then: nobody reads it
            pst.end("cancelled")
            raise ClientGone("the client went away before its prefill ended")
        pst.end()
        if encoded is not None:
            try:
                encoded.result()
            except grpc.RpcError as exc:
                raise _error("encode", exc, route.encode) from None
        yield wpb.TokenChunk(token_ids=[reply.first_token], text=reply.text, finished=True,
                             finish_reason=reply.finish_reason, prompt_tokens=len(req.prompt_ids), completion_tokens=1,
                             engine_seconds=reply.engine_seconds,
                             logprobs=[reply.first_logprobs] if reply.HasField("first_logprobs") else [],
                             prompt_logprobs=reply.prompt_logprobs)

    def _run_disaggregated(self, req: WorkerRequest, route: Route, slots: dict[str, Slot],
                           on_started: Callable[[], None]) -> Iterator[wpb.TokenChunk]:
        """``slots``: the workers' call slots; encode's and prefill's are given back as soon as their call
        ends (the decode worker's is held until the last token)."""
        assert route.prefill is not None
        md = self.security.call_metadata()
        decode = slots["decode"].stub(wgrpc.DecodeWorkerStub)
        prefill = slots["prefill"].stub(wgrpc.PrefillWorkerStub)
        params = sampling_to_proto(req.params)
        obs = RequestObserver(req.request_id)  # spans per call, parented on the caller's trace context
        st = obs.begin("reserve", traced=False)  # timed in epd:request_stage_seconds; no span (a short call)
        try:
            reply = decode.Reserve(wpb.ReserveRequest(request_id=req.request_id, prompt_token_ids=req.prompt_ids,
                                                      params=params, timeout_s=req.timeout_s,
                                                      image_positions=list(req.image_positions)),
                                   metadata=st.metadata(md), timeout=req.timeout_s)
        except grpc.RpcError as exc:
            st.end(exc)
            raise _error("reserve", exc, route.decode) from None
        st.end()
        try:
            on_started()
        except BaseException:  # the reservation is given back, not left to its timeout
            self._abort(req.request_id, route)
            raise
        futures: list[tuple[str, Future]] = []
        halt = Cancellation()  # the encode call's: the request cancelled, or this attempt over without it
        if req.images:
            if route.encode is None:
                self._abort(req.request_id, route)
                raise DispatchError("route", grpc.StatusCode.FAILED_PRECONDITION, "no encode worker for images")
            futures.append(("encode", self._encode(req, route, slots["encode"], obs, md, halt)))
        forget_halt = req.cancel.on_cancel(halt.cancel)
        pst = obs.begin("prefill", "prefill", prompt_tokens=len(req.prompt_ids))
        # cancelled with the request (its worker then aborts it wherever it is: an abort that came before the
        # worker held it would miss it, and an image prompt's prefill would wait for embeddings never sent)
        futures.append(("prefill", self._pool.submit(
            _call_until, prefill.Prefill,
            wpb.PrefillRequest(request_id=req.request_id, prompt_token_ids=req.prompt_ids, params=params,
                               kv_target=reply.kv_target, num_image_embeddings=len(req.image_positions),
                               image_positions=list(req.image_positions), timeout_s=req.timeout_s),
            pst.metadata(md), req.timeout_s, req.cancel)))
        futures[-1][1].add_done_callback(_ender(pst, req.cancel))
        dst = obs.begin("decode", "decode")
        stream = decode.Generate(wpb.GenerateRequest(request_id=req.request_id, keepalive_s=self.stream_keepalive_s),
                                 metadata=dst.metadata(md), timeout=req.timeout_s)
        def abort_if_failed(f: Future) -> None:
            if f.exception() and not halt.cancelled:  # halted: the attempt's end aborts the request
                self._abort(req.request_id, route)

        for stage, fut in futures:  # a failed stage aborts the request at once, so decode stops waiting
            slots[stage].end_with(fut, abort_if_failed)
        targets = {"encode": route.encode, "prefill": route.prefill}
        done = started = False
        lost: tuple[str, ...] = ()  # the workers this attempt lost (dead or hung)
        try:
            for chunk in self._watched(stream, "decode", route.decode, req.cancel, req.max_stall_s):
                if not started and req.params.prompt_logprobs is not None:
                    # decode sends its first token once the KV landed, so the Prefill reply is due at once
                    reply = self._stage_result("prefill", futures, targets, self.first_token_timeout_s)
                    del chunk.prompt_logprobs[:]
                    chunk.prompt_logprobs.extend(reply.prompt_logprobs)
                done, started = chunk.finished, True
                yield chunk
            for stage, fut in futures:  # surface an encode/prefill failure with its own message
                if not isinstance(fut.exception(), grpc.FutureCancelledError):  # halted after the last token
                    self._stage_result(stage, futures, targets, None)
        except _StageFailed as stage_failed:  # decode served; the other stage failed on its own
            lost = stage_failed.error.lost
            raise stage_failed.error from None
        except grpc.RpcError as exc:
            # grpc raises the call itself, which this frame holds (``stream``): detached, the two (and this
            # request's state) are freed when the request ends, not at the next full garbage collection
            detached(exc)
            if req.cancel.cancelled:  # the client left (this call was cancelled for it)
                dst.end("cancelled")
                raise ClientGone("the client went away") from None
            if not _broke(exc):  # the decode worker saw its KV fail: wait for the stage that broke it
                wait([f for _, f in futures], timeout=2.0)
            failed = [(s, f) for s, f in futures if f.done() and f.exception() is not None
                      and not isinstance(f.exception(), grpc.FutureCancelledError)]  # halted: not a failure
            decode_error = _error("decode", exc, route.decode)
            if failed:
                stage, fut = failed[0]
                err = fut.exception()
                dst.end(err)
                error = _error(stage, err, targets[stage])
                error.lost = lost = tuple(dict.fromkeys(error.lost + decode_error.lost))
                raise error from None
            dst.end(exc)
            lost = decode_error.lost
            raise decode_error from None
        except DispatchError as silent:  # a silent decode stream: its worker is named lost...
            verdict = silent
            stalled = next((f for stage, f in futures if stage == "prefill"), None)
            if not started and stalled is not None and not stalled.done():
                # ...unless the prefill never answered either: decode had no KV to start from, and a prefill
                # worker that is alive (its keepalive answered) but serves nothing is the one to move off
                verdict = DispatchError("prefill", grpc.StatusCode.UNAVAILABLE,
                                        f"worker {route.prefill} answered nothing for {self.first_token_timeout_s:g}"
                                        f" s while decode waited for its KV (hung?)", (route.prefill,))
            lost = verdict.lost
            raise verdict from None
        finally:
            forget_halt()
            dst.end(None if done else "cancelled")
            if not done:
                halt.cancel()  # an encode call still running is not waited for
                stream.cancel()
                self._abort(req.request_id, route, lost)

    def _encode(self, req: WorkerRequest, route: Route, slot: Slot, obs: RequestObserver,
                md: tuple[tuple[str, str], ...], halt: Cancellation) -> Future:
        """The request's Encode call, begun on the pool: a future of its reply. ``halt`` cancels the call
        (the request was cancelled, or its attempt ended without the embeddings): the encode worker sees its
        caller gone and stops before its push, or between its push's retries, rather than holding a call
        slot until the deadline; the future then raises ``grpc.FutureCancelledError`` and its stage ends as
        "cancelled", not as a failure."""
        stub = slot.stub(wgrpc.EncodeWorkerStub)
        est = obs.begin("encode", "encode", images=len(req.images))
        message = wpb.EncodeRequest(request_id=req.request_id, images=list(req.images),
                                    embeddings_target=route.prefill, timeout_s=req.timeout_s)
        future = self._pool.submit(_call_until, stub.Encode, message, est.metadata(md), req.timeout_s, halt)
        future.add_done_callback(_ender(est, halt))
        return future

    def _watched(self, stream: Iterator[wpb.TokenChunk], stage: str, target: str,
                 cancel: Cancellation, max_stall: float = math.inf) -> Iterator[wpb.TokenChunk]:
        """``stream``'s chunks; a stream silent past the idle limits ends in DispatchError(UNAVAILABLE)
        that names ``target`` lost (the watch cancelled the call, which frees its request there). The request's
        ``cancel`` cancels the call too (the client left). A keepalive chunk restarts the current limit
        and goes no further; keepalives alone for ``max_stall`` seconds (since the last chunk arrived, not
        counting the time the caller held it) end in DispatchError(UNAVAILABLE) that names ``target``
        stalled (the call cancelled, which frees its request there)."""
        key, w = self._watch.watch(stream, self.first_token_timeout_s, self.token_idle_timeout_s)  # type: ignore[arg-type]  # a grpc stream call is Cancellable; its stub type says Iterator
        # the whole stream long: a preempted request's next token may be a minute away
        forget = cancel.on_cancel(stream.cancel)  # type: ignore[attr-defined]  # a grpc stream call has cancel()
        last_token = time.monotonic()
        try:
            while True:
                w.resume()  # the idle clock runs only while this waits for the worker
                try:
                    chunk = next(stream)
                except StopIteration:
                    return
                if chunk.keepalive:  # the worker's engine moves; this request waits there (resumed above)
                    if time.monotonic() - last_token >= max_stall:
                        stream.cancel()  # type: ignore[attr-defined]  # a grpc stream call has cancel()
                        raise DispatchError(stage, grpc.StatusCode.UNAVAILABLE,
                                            f"worker {target} sent keepalives but no token for {max_stall:g} s "
                                            f"(the request waits there for KV blocks: preempted?)",
                                            stalled=(target,))
                    continue
                w.touch()
                yield chunk
                last_token = time.monotonic()  # the time the caller held the chunk is not the worker's
        except grpc.RpcError:
            if w.expired:
                raise DispatchError(stage, grpc.StatusCode.UNAVAILABLE,
                                    f"worker {target} sent nothing for {w.limit_s:g} s (hung?)", (target,)) from None
            raise
        finally:
            forget()
            self._watch.unwatch(key)

    @staticmethod
    def _stage_result(stage: str, futures: list[tuple[str, Future]], targets: dict[str, str | None],
                      timeout_s: float | None) -> Any:
        """The reply of ``stage``'s call (among ``futures``), waiting at most ``timeout_s``; _StageFailed naming
        that stage's worker when its call failed (or, past ``timeout_s``, as hung), ClientGone when it was
        cancelled for the request."""
        fut = next(f for s, f in futures if s == stage)
        try:
            return fut.result(timeout=timeout_s)
        except grpc.FutureCancelledError:  # the request was cancelled meanwhile (its client left)
            raise ClientGone("the client went away") from None
        except grpc.RpcError as exc:
            raise _StageFailed(_error(stage, exc, targets[stage])) from None
        except TimeoutError:
            target = targets[stage]
            raise _StageFailed(DispatchError(stage, grpc.StatusCode.UNAVAILABLE,
                                             f"worker {target} sent no {stage} reply {timeout_s:g} s after decode's "
                                             f"first token (hung?)", (target,) if target else ())) from None

    def _abort(self, rid: str, route: Route, lost: tuple[str, ...] = ()) -> None:
        self._abort_at(rid, [(wgrpc.DecodeWorkerStub, route.decode), (wgrpc.PrefillWorkerStub, route.prefill)],
                       lost)

    def _abort_at(self, rid: str, targets: list, lost: tuple[str, ...] = ()) -> None:
        """Send ``rid``'s Abort to every target at once. Those to live workers are waited for (each within
        its 5 s deadline): the request's next attempt may reserve on the same worker, and an abort landing
        after that would cancel the new reservation. Those to ``lost`` workers (dead or hung, never routed
        this request again) are not: a hung worker's abort takes its whole deadline, and the verdict that
        moves the request must not wait for it. A worker that never answers is gone; its own deadlines
        release what it held."""
        md = self.security.call_metadata()
        waited = []
        for stub, target in targets:
            if target is None:
                continue
            worker = self._channels.use(target)
            try:
                call = worker.stub(stub).Abort.future(wpb.AbortRequest(request_id=rid), metadata=md, timeout=5)
            except BaseException:
                self._channels.done(worker)
                raise
            call.add_done_callback(lambda _call, w=worker: self._aborted(w))
            if target not in lost:
                waited.append(call)
        for call in waited:
            try:
                call.result()
            except (grpc.RpcError, grpc.FutureCancelledError):
                pass

    def _aborted(self, worker: Worker) -> None:
        """An abort's call ended. grpc runs this on the channel's own polling thread, which must not close
        that channel (a retired entry's last call does): the bookkeeping runs on the pool, a moment's work."""
        try:
            self._pool.submit(self._channels.done, worker)
        except RuntimeError:  # the dispatcher was closed, and every channel with it
            pass
