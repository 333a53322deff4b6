"""What the three worker services share: proto <-> engine types, status, drain, and the gRPC server
that hosts a worker service next to its KVTransfer service behind one credential."""

from __future__ import annotations

import math
import queue
import socket
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, NoReturn, Protocol

import grpc

from epd.worker.v1 import worker_pb2 as wpb
from kvtransfer.auth import TransferSecurity
from kvtransfer.expectations import MAX_REQUEST_ID_CHARS
from kvtransfer.options import CHANNEL_OPTIONS, server_stream_options
from kvtransfer.server import handler_pool, released_on_failure
from kvtransfer.wire import FirstLogprobs
from workers.runtime.errors import (
    CapacityError,
    DuplicateRequestError,
    EngineError,
    InvalidImageError,
    InvalidRequestError,
    PromptTooLongError,
    RecomputeError,
    RequestTooLargeError,
)
from workers.runtime.sampler import SamplingParams, TokenLogprobs

if TYPE_CHECKING:
    from workers.engine_loop import EngineLoop


@dataclass
class WorkerIdentity:
    pool: str
    worker_id: str = ""
    address: str = ""  # host:port, known once the server is listening
    draining: bool = False

    def __post_init__(self) -> None:
        if not self.worker_id:
            self.worker_id = f"{self.pool}-{socket.gethostname()}-{uuid.uuid4().hex[:8]}"


class Drainable:
    """Drain and Resume, the same for every worker service (each has an ``identity`` and a ``Status``): a
    draining worker refuses new work (its request RPCs answer UNAVAILABLE), and what it runs finishes."""

    identity: WorkerIdentity

    def Status(self, request: wpb.StatusRequest, context: grpc.ServicerContext) -> wpb.WorkerStatus:
        raise NotImplementedError  # each service's own

    def Drain(self, request: wpb.DrainRequest, context: grpc.ServicerContext) -> wpb.WorkerStatus:
        self.identity.draining = True
        return self.Status(wpb.StatusRequest(), context)

    def Resume(self, request: wpb.ResumeRequest, context: grpc.ServicerContext) -> wpb.WorkerStatus:
        self.identity.draining = False
        return self.Status(wpb.StatusRequest(), context)

    def refuse_if_draining(self, context: grpc.ServicerContext) -> None:
        """End a call for new work with UNAVAILABLE while draining, marked as the worker's own refusal (the
        caller tries another worker and does not take this one for broken)."""
        if self.identity.draining:
            from workers.tracing import DRAINING_REFUSAL, mark_failure
            mark_failure(context, DRAINING_REFUSAL)
            context.abort(grpc.StatusCode.UNAVAILABLE,
                          f"{self.identity.pool} worker {self.identity.worker_id} is draining")


DEFAULT_TIMEOUT_S = 30.0  # a request's timeout_s of 0 (proto3's "unset")
MAX_TIMEOUT_S = 24 * 3600.0


class WorkerService(Protocol):
    """What each worker's service (encode, prefill, decode, colocated) offers the process running it."""

    def handlers(self) -> tuple[list, list]:
        """(functions that add the service to a gRPC server, generic handlers)."""
        ...

    def close(self) -> None: ...


class _HasRequestId(Protocol):
    request_id: str


class _HasTimeout(Protocol):
    timeout_s: float


class _HasKeepalive(Protocol):
    keepalive_s: float


def request_id_of(request: _HasRequestId) -> str:
    """The request's id; InvalidRequestError when it is empty or over ``MAX_REQUEST_ID_CHARS``."""
    rid = request.request_id
    if not rid:
        raise InvalidRequestError("request_id is required")
    if len(rid) > MAX_REQUEST_ID_CHARS:
        raise InvalidRequestError(f"request_id is {len(rid)} characters long; at most {MAX_REQUEST_ID_CHARS}")
    return rid


def timeout_of(request: _HasTimeout) -> float:
    """The request's ``timeout_s`` (0: ``DEFAULT_TIMEOUT_S``); InvalidRequestError when it is negative, not
    finite or over a day: a NaN deadline never passes, so whatever it guards would be held for good."""
    t = request.timeout_s
    if t == 0:
        return DEFAULT_TIMEOUT_S
    if not math.isfinite(t) or t < 0 or t > MAX_TIMEOUT_S:
        raise InvalidRequestError(f"timeout_s must be seconds in (0, {MAX_TIMEOUT_S:.0f}] (0 for the default "
                                  f"{DEFAULT_TIMEOUT_S:.0f}), got {t!r}")
    return t


MIN_KEEPALIVE_S = 0.01  # below, a stream would be mostly keepalives
KEEPALIVE_QUIET_S = 0.2  # an engine loop quiet for less is moving, however short the keepalive (it polls at 0.05 s)


def keepalive_of(request: _HasKeepalive) -> float:
    """The request's ``keepalive_s`` (0: none); InvalidRequestError when it is negative, not finite, under
    ``MIN_KEEPALIVE_S`` or over ``MAX_TIMEOUT_S``."""
    k = request.keepalive_s
    if k != 0 and not (math.isfinite(k) and MIN_KEEPALIVE_S <= k <= MAX_TIMEOUT_S):
        raise InvalidRequestError(f"keepalive_s must be seconds in [{MIN_KEEPALIVE_S:g}, {MAX_TIMEOUT_S:.0f}] "
                                  f"(0 for none), got {k!r}")
    return k


def sampling_from_proto(p: wpb.SamplingParams) -> SamplingParams:
    """Raises InvalidRequestError (an EngineError) for out-of-range values, max_tokens 0 (unset) included:
    a caller that forgot it used to get 16 tokens silently. top_p 0 (unset) is 1 (off)."""
    return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, top_p=p.top_p or 1.0,
                          top_k=p.top_k, seed=p.seed if p.HasField("seed") else None, stop=tuple(p.stop),
                          stop_token_ids=tuple(p.stop_token_ids), ignore_eos=p.ignore_eos, to_context=p.to_context,
                          logprobs=p.logprobs if p.HasField("logprobs") else None,
                          prompt_logprobs=p.prompt_logprobs if p.HasField("prompt_logprobs") else None)


UINT32_MAX = 2**32 - 1


def sampling_to_proto(s: SamplingParams) -> wpb.SamplingParams:
    """The wire's SamplingParams, meaning what ``s`` means: a top_k past uint32 (past any vocabulary, so
    off) is sent as the largest uint32; temperature and top_p travel as the doubles they are."""
    msg = wpb.SamplingParams(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p,
                             top_k=min(s.top_k, UINT32_MAX),
                             stop=list(s.stop), stop_token_ids=list(s.stop_token_ids), ignore_eos=s.ignore_eos,
                             to_context=s.to_context)
    if s.seed is not None:
        msg.seed = s.seed
    if s.logprobs is not None:
        msg.logprobs = s.logprobs
    if s.prompt_logprobs is not None:
        msg.prompt_logprobs = s.prompt_logprobs
    return msg


def logprobs_to_proto(t: TokenLogprobs) -> wpb.TokenLogprobs:
    return wpb.TokenLogprobs(logprob=t.logprob, top_ids=[i for i, _ in t.top], top_logprobs=[v for _, v in t.top])


def logprobs_from_proto(m: wpb.TokenLogprobs) -> TokenLogprobs:
    return TokenLogprobs(m.logprob, tuple(zip(m.top_ids, m.top_logprobs)))


def first_logprobs(t: TokenLogprobs | None) -> FirstLogprobs | None:
    """A token's logprobs as the KV transfer's finish carries them."""
    return None if t is None else (t.logprob, t.top)


def logprobs_of_first(f: FirstLogprobs | None) -> TokenLogprobs | None:
    """The first token's logprobs from a KV transfer's outcome (``first_logprobs``' inverse)."""
    return None if f is None else TokenLogprobs(*f)


def abort_for(context: grpc.ServicerContext, exc: EngineError, message: str | None = None) -> NoReturn:
    """End the call with ``exc``'s status and ``message`` (default: ``exc``'s text). A request that does not
    fit this worker's context or KV pool is marked so (``EXCEEDS_CONTEXT``): a request moved here after
    tokens were sent, that asked for as many tokens as fit, then ends with finish_reason "length"."""
    if isinstance(exc, (PromptTooLongError, RequestTooLargeError)):
        from workers.tracing import EXCEEDS_CONTEXT, mark_failure
        mark_failure(context, EXCEEDS_CONTEXT)
    context.abort(status_code_for(exc), message if message is not None else str(exc))
    raise AssertionError("context.abort returned")  # grpc's abort raises; a stand-in context may not


def status_code_for(exc: EngineError) -> grpc.StatusCode:
    if isinstance(exc, CapacityError):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(exc, RecomputeError):  # the path broke, not the request: the control plane moves it
        return grpc.StatusCode.ABORTED
    if isinstance(exc, DuplicateRequestError):
        return grpc.StatusCode.ALREADY_EXISTS
    if isinstance(exc, (PromptTooLongError, InvalidImageError)):
        return grpc.StatusCode.INVALID_ARGUMENT
    return grpc.StatusCode.INVALID_ARGUMENT


# The control plane pings worker channels every second or two to find a hung worker (SIGSTOPped: its
# kernel still acknowledges TCP). grpc's server default treats pings more often than every 5 minutes,
# while it sends nothing (a long prefill), as abuse and closes the connection with every call on it.
KEEPALIVE_SERVER_OPTIONS: tuple[tuple[str, int], ...] = (
    ("grpc.http2.min_ping_interval_without_data_ms", 500),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.keepalive_permit_without_calls", 1),
)


def start_worker_server(register: list, generic_handlers: list[grpc.GenericRpcHandler], address: str,
                        security: TransferSecurity, max_streams: int = 64,
                        identity: WorkerIdentity | None = None) -> tuple[grpc.Server, int]:
    """One server for a worker: ``register`` holds (add_XServicer_to_server, servicer) pairs. Calls that
    carry a W3C ``traceparent`` get a server span (workers.tracing), after the credential check."""
    from workers.tracing import TracingInterceptor

    pool = identity.pool if identity is not None else ""
    tracing = TracingInterceptor(pool, (lambda: identity.worker_id) if identity is not None else "")
    handlers = handler_pool(max_streams + 16, "worker")
    server = grpc.server(handlers, interceptors=[*security.interceptors(), tracing],
                         options=CHANNEL_OPTIONS + server_stream_options(max_streams + 8) + KEEPALIVE_SERVER_OPTIONS)
    with released_on_failure(handlers):
        for add, servicer in register:
            add(servicer, server)
        server.add_generic_rpc_handlers(tuple(generic_handlers))
        port = security.add_port(server, address)
        server.start()
    return server, port


def stream_tokens(loop: EngineLoop, request_id: str, q: queue.Queue, prompt_tokens: int,
                  context: grpc.ServicerContext, whole: bool = False, keepalive_s: float = 0.0
                  ) -> Iterator[wpb.TokenChunk]:
    """Relay a request's outputs from its engine-loop queue as TokenChunks until it finishes. A caller that
    goes away aborts the request (freeing its blocks); an engine failure ends the call with its status.
    ``whole``: this engine ran the whole request, so the finished chunk carries its engine time.
    ``keepalive_s`` (0: none): after the first chunk, each ``keepalive_s`` without one sends a keepalive
    chunk, only while the engine loop has ended a cycle or an idle wait within ``keepalive_s`` (at least
    ``KEEPALIVE_QUIET_S``; ``EngineLoop.quiet_for``) and still holds the request: the caller's watch then
    still sees a stuck engine go silent, and only a request that waits while the engine moves (a
    preempted one) is kept alive."""
    from workers.engine_loop import LoopFailure

    finished = threading.Event()

    def on_rpc_done() -> None:
        if not finished.is_set():
            loop.abort(request_id)

    context.add_callback(on_rpc_done)
    started = False
    while True:
        try:
            item = q.get(timeout=keepalive_s) if started and keepalive_s > 0 else q.get()
        except queue.Empty:
            if loop.quiet_for() < max(keepalive_s, KEEPALIVE_QUIET_S) and loop.holds(request_id):
                yield wpb.TokenChunk(keepalive=True)
            continue
        started = True
        if isinstance(item, LoopFailure):
            finished.set()
            if item.error:
                abort_for(context, item.error, item.message)
            context.abort(grpc.StatusCode.INTERNAL, item.message)
        chunk = wpb.TokenChunk(token_ids=list(item.new_token_ids), text=item.text, finished=item.finished,
                               prompt_tokens=prompt_tokens, completion_tokens=item.num_output_tokens)
        if item.logprobs is not None:
            chunk.logprobs.append(logprobs_to_proto(item.logprobs))
        if item.prompt_logprobs:
            chunk.prompt_logprobs.extend(logprobs_to_proto(t) for t in item.prompt_logprobs)
        if item.finished:
            finished.set()
            chunk.finish_reason = item.finish_reason.value if item.finish_reason else ""
            if whole:
                chunk.engine_seconds = item.engine_seconds
        yield chunk
        if item.finished:
            return
