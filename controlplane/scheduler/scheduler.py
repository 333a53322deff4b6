"""The scheduler: picks the replicas for each request and drives it through them (the ingress's Backend).

A request's life here:
  1. QUEUED     admitted if fewer than ``queue_size`` requests wait; else 429 at once.
  2. ROUTED     the routing policy picks a decode, a prefill and (images) an encode replica among
                the live, non-draining workers of the Redis registry.
  3. RESERVED   the decode replica holds blocks for the prompt. A full or draining replica is
                skipped and the next tried; when none has room the request waits (backing off) up
                to ``queue_timeout_s``, then gets 429 with Retry-After. It never waits unbounded.
  4. STREAMING  encode, prefill and decode run over the worker services (controlplane.dispatch);
                chunks go back to the ingress as they come.
  5. FINISHED / FAILED  recorded in the journal with the time; counters move.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable, Iterator

import grpc

from controlplane.backend import BackendError, Chunk, ModelInfo, Overloaded
from controlplane.dispatch import DispatchError, Dispatcher, Route, WorkerRequest
from controlplane.observability import metrics
from controlplane.observability.stages import queued as queued_stage
from controlplane.observability.tracing import current_parent
from controlplane.scheduler.policies import Candidate, RoutingPolicy
from controlplane.settings import SchedulerSettings
from controlplane.state.errors import StateError
from controlplane.state.journal import BackgroundJournal, RequestJournal, RequestState
from controlplane.state.registry import WorkerRegistry

_RETRY_AT_RESERVE = (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE)
_CLIENT_FAULT = (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.OUT_OF_RANGE)


class WorkerView:
    """The routable workers per pool, read from the registry at most every ``refresh_s`` seconds,
    plus what this scheduler has sent each one since (so a burst does not pile on one replica).
    One thread at a time rereads a stale pool (``redis.list`` of 64 workers is ~2.5 ms of decoding
    under the GIL); requests arriving meanwhile route on the snapshot it is replacing."""

    def __init__(self, registry: WorkerRegistry, refresh_s: float = 0.2,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.registry = registry
        self.refresh_s = refresh_s
        self.clock = clock
        self._cache: dict[str, tuple[float, list[Candidate]]] = {}
        self._refreshing: set[str] = set()  # pools whose snapshot a thread is rereading now
        self._inflight: dict[str, list[int]] = {}  # worker id -> [tokens, requests]
        self._lock = threading.Lock()

    def candidates(self, pool: str) -> list[Candidate]:
        now = self.clock()
        with self._lock:
            cached = self._cache.get(pool)
            stale = cached is None or now - cached[0] > self.refresh_s
            # one thread rereads a stale snapshot; the others route on it meanwhile (it is at most one
            # reread old), instead of every request thread decoding the whole pool from Redis at once
            reread = stale and (cached is None or pool not in self._refreshing)
            if reread:
                self._refreshing.add(pool)
        if reread:
            try:
                records = [r for r in self.registry.live_workers(pool) if not r.info.draining]
                fresh = [Candidate(r.info.worker_id, r.info.address, r.info.load.queued_tokens,
                                   r.info.load.free_kv_blocks, r.info.load.total_kv_blocks, r.info.load.running)
                         for r in records]
                with self._lock:
                    self._cache[pool] = cached = (now, fresh)
            finally:
                with self._lock:
                    self._refreshing.discard(pool)
        assert cached is not None
        inflight, none = self._inflight, (0, 0)
        with self._lock:  # the snapshot's rows with this scheduler's own in-flight work on each worker
            return [Candidate(*c[:6], *inflight.get(c[0], none)) for c in cached[1]]

    def begin(self, worker_id: str, tokens: int) -> None:
        with self._lock:
            entry = self._inflight.setdefault(worker_id, [0, 0])
            entry[0] += tokens
            entry[1] += 1

    def end(self, worker_id: str, tokens: int) -> None:
        with self._lock:
            entry = self._inflight.get(worker_id)
            if entry is not None:
                entry[0] -= tokens
                entry[1] -= 1
                if entry[1] <= 0:
                    del self._inflight[worker_id]

    def invalidate(self) -> None:
        with self._lock:
            self._cache.clear()


class Scheduler:
    def __init__(self, model: ModelInfo, view: WorkerView, dispatcher: Dispatcher, policy: RoutingPolicy,
                 settings: SchedulerSettings, journal: RequestJournal | BackgroundJournal | None = None, *,
                 colocated: bool = False) -> None:
        """``colocated``: route every request to one decode-pool worker that runs it whole."""
        self.model = model
        self.colocated = colocated
        self.view = view
        self.dispatcher = dispatcher
        self.policy = policy
        self.settings = settings
        self.journal = journal
        self._waiting = 0
        self._lock = threading.Lock()

    def ready(self) -> bool:
        pools = ["decode"] if self.colocated else (
            ["prefill", "decode"] + (["encode"] if self.model.image_token_id is not None else []))
        try:
            return all(self.view.candidates(p) for p in pools)
        except Exception:  # Redis unreachable: not ready
            return False

    @property
    def waiting(self) -> int:
        return self._waiting

    def _record(self, rid: str, state: RequestState, detail: str = "") -> None:
        if self.journal is not None:
            try:
                self.journal.record(rid, state, time.time(), detail)
            except Exception:  # the journal is best effort; Redis trouble must not fail requests
                pass

    def _candidates(self, pool: str) -> list[Candidate]:
        """The pool's routable workers; a Redis outage is a 503 that says so, not an internal error."""
        try:
            return self.view.candidates(pool)
        except StateError as exc:
            raise BackendError(f"the routing state (Redis) is unavailable, retry shortly: {exc}", 503) from None

    def _pick(self, pool: str, request: WorkerRequest, exclude: set[str]) -> Candidate | None:
        candidates = [c for c in self._candidates(pool) if c.worker_id not in exclude]
        tokens = len(request.prompt_ids)
        return self.policy.pick(pool, candidates, tokens, prompt_ids=request.prompt_ids) if candidates else None

    def generate(self, request: WorkerRequest) -> Iterator[Chunk]:
        rid = request.request_id
        parent, admitted_ns = current_parent(), time.time_ns()  # the "queue" span: admission -> routed
        with self._lock:
            if self._waiting >= self.settings.queue_size:
                metrics.rejected("queue_full")
                raise Overloaded(f"{self._waiting} requests are already waiting for decode room", 1.0)
            self._waiting += 1
        self._record(rid, RequestState.QUEUED)
        queued = True
        try:
            admitted = time.monotonic()
            deadline = admitted + self.settings.queue_timeout_s
            backoff = 0.01
            tokens = len(request.prompt_ids)
            while True:
                refused: set[str] = set()
                while True:
                    decode = self._pick("decode", request, refused)
                    if decode is None:
                        break
                    prefill = encode = None
                    if not self.colocated:
                        prefill = self._pick("prefill", request, set())
                        encode = self._pick("encode", request, set()) if request.images else None
                        missing = [pool for pool, c in (("prefill", prefill), ("encode", encode))
                                   if c is None and (pool == "prefill" or request.images)]
                        if missing:
                            raise BackendError(f"no live {' or '.join(missing)} replica to serve the request", 503)
                    route = Route(decode.address, prefill.address if prefill else None,
                                  encode.address if encode else None)
                    chosen = [c.worker_id for c in (decode, prefill, encode) if c is not None]
                    for w in chosen:
                        self.view.begin(w, tokens)
                    attempt_ns = time.time_ns()
                    # the request's deadline (scheduler.request_timeout_s) counts from admission
                    left = max(0.001, self.settings.request_timeout_s - (time.monotonic() - admitted))
                    try:
                        stream = self.dispatcher.run(dataclasses.replace(request, timeout_s=left), route)
                        first = next(stream)  # reserve happens before the first chunk
                    except DispatchError as exc:
                        for w in chosen:
                            self.view.end(w, tokens)
                        if exc.stage in ("reserve", "complete") and exc.code in _RETRY_AT_RESERVE:
                            refused.add(decode.worker_id)
                            continue
                        if exc.stage == "busy":  # a chosen worker is at its call cap: wait, as for room
                            break
                        self._record(rid, RequestState.FAILED, f"{exc.stage}: {exc.message}")
                        raise _backend_error(exc) from None
                    except BaseException as exc:  # a bug or an interrupt: the routing counts still drop
                        for w in chosen:
                            self.view.end(w, tokens)
                        self._record(rid, RequestState.FAILED, f"internal error: {type(exc).__name__}")
                        raise
                    if queued:
                        with self._lock:
                            self._waiting -= 1
                        queued = False
                        queued_stage(rid, parent, admitted_ns, attempt_ns)
                    self._record(rid, RequestState.DECODING, " ".join(
                        f"{name}={c.worker_id}" for name, c in (("decode", decode), ("prefill", prefill),
                                                                 ("encode", encode)) if c is not None))
                    try:
                        yield from self._relay(first, stream)
                    except DispatchError as exc:
                        self._record(rid, RequestState.FAILED, f"{exc.stage}: {exc.message}")
                        raise _backend_error(exc) from None
                    except GeneratorExit:  # the ingress closed the stream: the client went away
                        self._record(rid, RequestState.ABORTED, "the client went away")
                        raise
                    except BaseException as exc:
                        self._record(rid, RequestState.FAILED, f"internal error: {type(exc).__name__}")
                        raise
                    finally:
                        for w in chosen:
                            self.view.end(w, tokens)
                    self._record(rid, RequestState.FINISHED)
                    return
                if not self._candidates("decode"):
                    raise BackendError("no live decode replica to serve the request", 503)
                if time.monotonic() + backoff > deadline:
                    self._record(rid, RequestState.FAILED, "no decode room in time")
                    metrics.rejected("queue_timeout")
                    queued_stage(rid, parent, admitted_ns, time.time_ns(), "no decode room in time")
                    raise Overloaded("every replica that could take it is full; retry later", max(1.0, backoff * 10))
                time.sleep(backoff)
                backoff = min(backoff * 2, 0.2)
                self.view.invalidate()
        except BackendError as exc:  # refused before streaming (no replica, Redis away): say so in the journal
            if exc.status == 503:
                self._record(rid, RequestState.FAILED, str(exc))
            raise
        finally:
            if queued:
                with self._lock:
                    self._waiting -= 1

    @staticmethod
    def _relay(first, stream) -> Iterator[Chunk]:  # type: ignore[no-untyped-def]
        for chunk in _chain(first, stream):
            yield Chunk.from_wire(chunk)


def _chain(first, rest):  # type: ignore[no-untyped-def]
    yield first
    yield from rest


def _backend_error(exc: DispatchError) -> BackendError:
    if exc.code in _CLIENT_FAULT:
        return BackendError(exc.message, 400, "invalid_request_error")
    if exc.code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return BackendError(f"{exc.stage} timed out: {exc.message}", 504)
    return BackendError(f"{exc.stage} failed: {exc.message}", 502)
