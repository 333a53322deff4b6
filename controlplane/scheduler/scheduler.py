"""The scheduler: picks the replicas for each request and drives it through them (the ingress's Backend).

A request's life here, one named stage each:
  1. QUEUED     admission (``admission``): admitted if fewer than ``queue_size`` requests wait; else 429.
  2. ROUTED     route selection (``selection``): the routing policy picks a decode, a prefill and
                (images) an encode replica among the live, non-draining, trusted workers.
  3. RESERVED   one attempt (``attempt``): the decode replica holds blocks for the prompt. A full or
                draining replica is skipped and the next tried; when none has room the request waits
                (backing off) up to ``queue_timeout_s``, then gets 429 with Retry-After.
  4. STREAMING  the relay: encode, prefill and decode run over the worker services (controlplane.dispatch);
                chunks go back to the ingress as they come.
  5. FINISHED / FAILED / ABORTED  recorded in the journal with the time; counters move.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from controlplane.backend import BackendError, Chunk, ModelInfo, Overloaded
from controlplane.dispatch import DispatchError, Dispatcher, WorkerRequest
from controlplane.observability import metrics
from controlplane.observability.stages import queued as queued_stage
from controlplane.observability.tracing import current_parent
from controlplane.scheduler.admission import Admission, Ticket
from controlplane.scheduler.attempt import Attempt
from controlplane.scheduler.failures import Verdict, backend_error, verdict
from controlplane.scheduler.health import WorkerHealth
from controlplane.scheduler.policies import RoutingPolicy
from controlplane.scheduler.selection import RETRY_AFTER_S, RouteSelector
from controlplane.scheduler.worker_view import WorkerView
from controlplane.settings import SchedulerSettings
from controlplane.state.journal import BackgroundJournal, RequestJournal, RequestState

__all__ = ["Scheduler", "WorkerView"]


class Scheduler:
    def __init__(self, model: ModelInfo, view: WorkerView, dispatcher: Dispatcher, policy: RoutingPolicy,
                 settings: SchedulerSettings, journal: RequestJournal | BackgroundJournal | None = None, *,
                 colocated: bool = False, health: WorkerHealth | None = None) -> None:
        """``colocated``: route every request to one decode-pool worker that runs it whole."""
        self.model = model
        self.colocated = colocated
        self.view = view
        self.dispatcher = dispatcher
        self.policy = policy
        self.settings = settings
        self.journal = journal
        self.health = health or WorkerHealth(settings.breaker_failures, settings.breaker_open_s)
        self.admission = Admission(settings.queue_size)
        self.selector = RouteSelector(view, policy, self.health, colocated=colocated)

    def ready(self) -> bool:
        pools = ["decode"] if self.colocated else (
            ["prefill", "decode"] + (["encode"] if self.model.image_token_id is not None else []))
        try:
            return all(self.view.candidates(p) for p in pools)
        except Exception:  # Redis unreachable and no snapshot yet: not ready
            return False

    @property
    def waiting(self) -> int:
        return self.admission.waiting

    def _record(self, rid: str, state: RequestState, detail: str = "") -> None:
        if self.journal is not None:
            try:
                self.journal.record(rid, state, time.time(), detail)
            except Exception:  # the journal is best effort; Redis trouble must not fail requests
                pass

    def generate(self, request: WorkerRequest) -> Iterator[Chunk]:
        rid = request.request_id
        parent, admitted_ns = current_parent(), time.time_ns()  # the "queue" span: admission -> routed
        with self.admission.admit() as ticket:
            self._record(rid, RequestState.QUEUED)
            admitted = time.monotonic()
            try:
                attempt = self._route(request, ticket, admitted, parent, admitted_ns)
                with attempt:
                    self._record(rid, RequestState.DECODING, attempt.selection.describe())
                    yield from self._relay(rid, attempt)
                self._record(rid, RequestState.FINISHED)
            except BackendError as exc:  # refused before streaming (no replica, Redis away): say so in the journal
                if exc.status == 503:
                    self._record(rid, RequestState.FAILED, str(exc))
                raise

    def _route(self, request: WorkerRequest, ticket: Ticket, admitted: float, parent: object,
               admitted_ns: int) -> Attempt:
        """An opened attempt, waiting (backing off) for decode room up to ``queue_timeout_s``."""
        rid = request.request_id
        deadline = admitted + self.settings.queue_timeout_s
        backoff = 0.01
        while True:
            refused: set[str] = set()
            while (selection := self.selector.select(request, refused)) is not None:
                attempt_ns = time.time_ns()
                # the request's deadline (scheduler.request_timeout_s) counts from admission
                left = max(0.001, self.settings.request_timeout_s - (time.monotonic() - admitted))
                try:
                    attempt = Attempt.open(self.view, self.health, self.dispatcher, selection, request, left)
                except DispatchError as exc:
                    v = verdict(exc, started=False)
                    if v is Verdict.REFUSED:
                        refused.add(selection.decode.worker_id)
                        continue
                    if v is Verdict.BUSY:
                        break
                    self._record(rid, RequestState.FAILED, f"{exc.stage}: {exc.message}")
                    raise backend_error(exc) from None
                except BaseException as exc:  # a bug or an interrupt: the attempt gave its counts back
                    self._record(rid, RequestState.FAILED, f"internal error: {type(exc).__name__}")
                    raise
                if ticket.routed():
                    queued_stage(rid, parent, admitted_ns, attempt_ns)
                return attempt
            if not self.selector.candidates("decode"):
                raise BackendError("no live decode replica to serve the request", 503, retry_after_s=RETRY_AFTER_S)
            if time.monotonic() + backoff > deadline:
                self._record(rid, RequestState.FAILED, "no decode room in time")
                metrics.rejected("queue_timeout")
                queued_stage(rid, parent, admitted_ns, time.time_ns(), "no decode room in time")
                raise Overloaded("every replica that could take it is full; retry later", max(1.0, backoff * 10))
            time.sleep(backoff)
            backoff = min(backoff * 2, 0.2)
            self.view.invalidate()

    def _relay(self, rid: str, attempt: Attempt) -> Iterator[Chunk]:
        try:
            for chunk in attempt.chunks():
                yield Chunk.from_wire(chunk)
        except DispatchError as exc:
            self._record(rid, RequestState.FAILED, f"{exc.stage}: {exc.message}")
            raise backend_error(exc) from None
        except GeneratorExit:  # the ingress closed the stream: the client went away
            self._record(rid, RequestState.ABORTED, "the client went away")
            raise
        except BaseException as exc:
            self._record(rid, RequestState.FAILED, f"internal error: {type(exc).__name__}")
            raise
