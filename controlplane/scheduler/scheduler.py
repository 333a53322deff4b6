"""The scheduler: picks the replicas for each request and drives it through them (the ingress's Backend).

A request's life here, one named stage each:
  1. QUEUED     admission (``admission``): admitted if fewer than ``queue_size`` requests wait; else 429.
  2. ROUTED     route selection (``selection``): the routing policy picks a decode, a prefill and
                (images) an encode replica among the live, non-draining, trusted workers.
  3. RESERVED   one attempt (``attempt``): the decode replica holds blocks for the prompt. A full or
                draining replica is skipped and the next tried; when none has room the request waits
                (backing off) up to ``queue_timeout_s``, then gets 429 with Retry-After.
  4. STREAMING  the relay (``relay``): encode, prefill and decode run over the worker services
                (controlplane.dispatch); chunks go back to the ingress as they come.
  4b. MIGRATING a worker the attempt used died or hung (``Verdict.LOST``): it is suspect to routing,
                the attempt gives back what it held, and a new attempt on other workers re-prefills
                the prompt plus the tokens sent so far; the client's stream carries on. A decode
                worker that stalled the request (keepalives only for ``max_stall_s``: preempted, waiting
                for blocks) is moved off the same way, but only passed over by this request. After
                ``migration_limit`` moves the request ends with a retriable 503 naming the cause.
  5. FINISHED / FAILED / ABORTED  recorded in the journal with the time; counters move.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Iterator

from controlplane.backend import BackendError, Chunk, ModelInfo, Overloaded
from controlplane.cancellation import ClientGone
from controlplane.dispatch import Dispatcher, DispatchError, WorkerRequest
from controlplane.observability import metrics
from controlplane.observability.stages import queued as queued_stage
from controlplane.observability.tracing import current_parent
from controlplane.scheduler.admission import Admission, Ticket
from controlplane.scheduler.attempt import Attempt
from controlplane.scheduler.failures import Verdict, backend_error, verdict
from controlplane.scheduler.health import WorkerHealth
from controlplane.scheduler.policies import Candidate, RoutingPolicy
from controlplane.scheduler.relay import Progress
from controlplane.scheduler.room_queue import RoomQueue
from controlplane.scheduler.selection import RETRY_AFTER_S, RouteSelector, Selection
from controlplane.scheduler.worker_view import WorkerView
from controlplane.settings import SchedulerSettings
from controlplane.state.errors import StateError
from controlplane.state.journal import BackgroundJournal, RequestJournal, RequestState
from workers.tracing import EXCEEDS_CONTEXT

__all__ = ["Scheduler", "WorkerView"]

log = logging.getLogger(__name__)


class _Lost(Exception):
    """An attempt lost a worker (``error.lost``, on ``selection``) or was stalled on one (``error.stalled``), or a
    link between two broke: the request moves."""

    def __init__(self, error: DispatchError, selection: Selection) -> None:
        super().__init__(str(error))
        self.error, self.selection = error, selection


class _Refused(Exception):
    """Live workers refused an attempt because they drain (their addresses, on ``selection``): the request
    tries others, with no move counted and no worker marked suspect."""

    def __init__(self, error: DispatchError, selection: Selection) -> None:
        super().__init__(str(error))
        self.workers = selection.ids(error.refused)


class _ContextFull(Exception):
    """A moved request that asked for as many tokens as fit (``to_context``) fits on no worker left to try
    (every decode replica left, or every prefill replica left, has a KV pool too small for it): the tokens
    sent are all there is room for, so it finishes with finish_reason "length" rather than an error after
    its 200."""


def _context_full(exc: DispatchError, request: WorkerRequest, moved: bool) -> bool:
    return moved and request.params.to_context and exc.mark == EXCEEDS_CONTEXT


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
        self.room = RoomQueue(settings.fcfs_after_s)
        self.selector = RouteSelector(view, policy, self.health, colocated=colocated,
                                      max_calls=dispatcher.max_calls_per_worker if dispatcher is not None else None)

    def ready(self) -> bool:
        pools = ["decode"] if self.colocated else (
            ["prefill", "decode"] + (["encode"] if self.model.image_token_id is not None else []))
        try:  # a worker routing would pass over (its breaker open: it just failed calls) does not count
            return all(any(self.health.routable(c.worker_id) for c in self.view.candidates(p)) for p in pools)
        except Exception:  # Redis unreachable and no snapshot yet: not ready
            return False

    def degraded(self) -> str | None:
        """Redis stalled (routing on its last good snapshot) and the workers routing avoids, or None."""
        notes = []
        d = self.view.degraded
        if d is not None:
            age = self.view.clock() - d.since
            notes.append(f"Redis is degraded: routing on its last good snapshot for {age:.0f} s "
                         f"({d.reason})")
        suspects = self.health.suspects()
        if suspects:  # a suspect the registry no longer lists was replaced: forget it
            try:
                listed = {c.worker_id for pool in ("encode", "prefill", "decode") for c in self.view.candidates(pool)}
            except StateError:
                listed = {s.worker_id for s in suspects}
            for s in suspects:
                if s.worker_id not in listed:
                    self.health.forget(s.worker_id)
            suspects = [s for s in suspects if s.worker_id in listed]
        if suspects:
            notes.append("suspect workers, not routed until a probe succeeds: " + ", ".join(
                f"{s.worker_id} ({s.state.value}: {s.reason})" for s in suspects))
        return "; ".join(notes) or None

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
            admitted = wait_from = time.monotonic()
            progress = Progress(request, self.model.tokenizer)
            lost: set[str] = set()  # workers this request lost, or that refused it draining: never tried again
            cramped: set[str] = set()  # of those, decode workers whose KV pool cannot hold it since a move
            moves = 0
            try:
                while True:
                    try:
                        progress.begin_attempt()
                        attempt = self._route(progress.continuation(), ticket, admitted, wait_from, lost,
                                              parent, admitted_ns, streamed=bool(progress.token_ids),
                                              cramped=cramped)
                        with attempt:
                            self._record(rid, RequestState.DECODING, attempt.selection.describe())
                            yield from self._relay(rid, attempt, progress)
                            for c in attempt.selection.workers:
                                self.health.success(c.worker_id)
                        self._record(rid, RequestState.FINISHED)
                        return
                    except _Lost as exc:
                        self._moved(rid, exc, progress, lost, moves)
                        moves += 1
                        wait_from = time.monotonic()
                    except _Refused as exc:  # refused at its start, nothing streamed: the next route, no move
                        lost.update(exc.workers)
                    except _ContextFull as exc:
                        log.info("request %s ends after %d tokens, finish_reason length: %s", rid,
                                 len(progress.token_ids), exc)
                        self._record(rid, RequestState.FINISHED, f"length: no room after the move: {exc}")
                        yield progress.end("length")
                        return
            except BackendError as exc:  # refused before streaming (no replica, Redis away): say so in the journal
                if exc.status == 503:
                    self._record(rid, RequestState.FAILED, str(exc))
                raise
            except ClientGone as exc:  # cancelled by the ingress (its client left): aborted on the workers
                self._record(rid, RequestState.ABORTED, str(exc))
                raise

    def _moved(self, rid: str, lost_exc: _Lost, progress: Progress, lost: set[str], moves: int) -> None:
        """Mark the lost workers suspect (a stalled one is only passed over by this request: it is alive,
        just full); past ``migration_limit`` moves (``moves`` made so far), the retriable 503 naming the
        cause."""
        error, selection = lost_exc.error, lost_exc.selection
        names = selection.ids(error.lost)
        for worker_id in names:
            lost.add(worker_id)
            self.health.failure(worker_id, f"{error.stage}: {error.message}", lost=True)
        stalled = selection.ids(error.stalled)
        lost.update(stalled)
        if names:
            cause = f"{error.stage} worker {', '.join(names)} lost: {error.message}"
        elif stalled:
            cause = f"{error.stage} worker {', '.join(stalled)} stalled: {error.message}"
        else:  # no worker lost: a link between two broke (a KV push's connection, say)
            cause = f"{error.stage} failed on the path {selection.describe()}: {error.message}"
        log.warning("request %s: %s (after %d tokens, move %d of at most %d)", rid, cause, len(progress.token_ids),
                    moves + 1, self.settings.migration_limit)
        if moves >= self.settings.migration_limit:
            raise BackendError(f"the request had to move {moves + 1} times, more than the migration limit "
                               f"({self.settings.migration_limit}); retry it. Last: {cause}", 503,
                               retry_after_s=RETRY_AFTER_S)
        metrics.migrated(str(error.stage))
        self._record(rid, RequestState.MIGRATING, f"after {len(progress.token_ids)} tokens; {cause}")

    def _route(self, request: WorkerRequest, ticket: Ticket, admitted: float, wait_from: float, lost: set[str],
               parent: object, admitted_ns: int, *, streamed: bool = False,
               cramped: set[str] | None = None) -> Attempt:
        """An opened attempt, waiting (backing off) for decode room up to ``queue_timeout_s`` after
        ``wait_from``; _Lost when it lost a worker before its first chunk. The request leaves the queue (its
        ``ticket``, the waiting count and the "queue" stage) once the workers hold it: the decode
        reservation made, not its first token, which comes after prefill. ``streamed``: it has tokens
        already (a move), so a worker too small for it is passed over rather than failing it. ``cramped`` (the
        request's, across its moves) collects the decode workers too small for it: once no other is left,
        _ContextFull. A prefill worker too small for it joins ``lost``: once no other prefill worker is left,
        _ContextFull too."""
        rid = request.request_id
        try:
            return self._route_in_turn(request, ticket, admitted, wait_from, lost, parent, admitted_ns,
                                       streamed, cramped if cramped is not None else set())
        finally:
            self.room.leave(rid)

    def _route_in_turn(self, request: WorkerRequest, ticket: Ticket, admitted: float, wait_from: float,
                       lost: set[str], parent: object, admitted_ns: int, streamed: bool, cramped: set[str]) -> Attempt:
        """_route's loop. A request that waits for decode room waits in ``self.room``: once the earliest
        admitted of those has waited ``scheduler.fcfs_after_s``, requests admitted after it leave alone the
        replicas that refused it. A moved request (``streamed``: its client has tokens), and a one-token request
        on a disaggregated route (it takes no decode room), are never held back."""
        rid = request.request_id
        deadline = wait_from + self.settings.queue_timeout_s
        backoff = 0.01
        held = False  # it was kept off a replica an earlier request waits to drain
        while True:
            if request.cancel.cancelled:
                raise ClientGone("the client went away before the request was routed")
            free = streamed or (request.prefill_only and not self.colocated)
            hold = frozenset() if free else self.room.held_from(rid, admitted)
            held = held or bool(hold)
            refused: set[str] = set(hold)
            busy = False
            while (selection := self.selector.select(request, refused, lost)) is not None:
                attempt_ns = time.time_ns()
                took: list[bool] = []  # whether this attempt took the request out of the queue

                def started(took: list[bool] = took) -> None:
                    if ticket.routed():
                        took.append(True)
                # the request's deadline (scheduler.request_timeout_s) counts from admission
                left = max(0.001, self.settings.request_timeout_s - (time.monotonic() - admitted))
                try:
                    try:
                        attempt = Attempt.open(self.view, self.health, self.dispatcher, selection,
                                               self._with_stall_bound(request, selection, lost), left,
                                               on_started=started)
                    except BaseException:
                        if took:  # failed before its first token: it waits again, holding its place
                            ticket.requeue()
                        raise
                except DispatchError as exc:
                    if exc.refused:  # live workers that drain: tried no more for this request, not suspect
                        lost.update(selection.ids(exc.refused))
                        continue
                    v = verdict(exc, started=False)
                    if v is Verdict.REFUSED:
                        refused.add(selection.decode.worker_id)
                        for worker_id in selection.ids(exc.lost):  # refused because it is gone, not full
                            lost.add(worker_id)
                            self.health.failure(worker_id, exc.message, lost=True)
                        continue
                    if v is Verdict.BUSY:
                        busy = True
                        break
                    if v is Verdict.LOST:
                        raise _Lost(exc, selection) from None
                    if _context_full(exc, request, streamed):
                        if exc.stage == "prefill" and selection.prefill is not None:
                            # a prefill pool too small for the prompt so far: now and later (the request only
                            # grows), but another prefill replica's may hold it
                            lost.add(selection.prefill.worker_id)
                            if not self._routable("prefill", lost):
                                raise _ContextFull(f"prefill worker {selection.prefill.worker_id} cannot hold its "
                                                   f"{len(request.prompt_ids)} tokens, and no other prefill "
                                                   f"replica is left: {exc.message}") from None
                            continue
                        lost.add(selection.decode.worker_id)  # too small now, and later: the request only grows
                        cramped.add(selection.decode.worker_id)
                        continue
                    self._record(rid, RequestState.FAILED, f"{exc.stage}: {exc.message}")
                    raise backend_error(exc) from None
                except ClientGone:
                    raise
                except BaseException as exc:  # a bug or an interrupt: the attempt gave its counts back
                    self._record(rid, RequestState.FAILED, f"internal error: {type(exc).__name__}")
                    raise
                started()  # where the dispatch had no such moment to tell
                if took:
                    queued_stage(rid, parent, admitted_ns, attempt_ns)
                return attempt
            if not self._routable("decode", lost):
                if cramped:  # every decode replica left holds fewer tokens than it has
                    raise _ContextFull(f"decode workers {', '.join(sorted(cramped))} cannot hold its "
                                       f"{len(request.prompt_ids)} tokens, and no other is left")
                raise BackendError(self._no_decode_replica(self.selector.candidates("decode"), lost), 503,
                                   retry_after_s=RETRY_AFTER_S)
            if time.monotonic() + backoff > deadline:
                self._record(rid, RequestState.FAILED, "no decode room in time")
                if ticket.queued:  # once the workers held it, its queue stage ended
                    queued_stage(rid, parent, admitted_ns, time.time_ns(), "no decode room in time")
                why = " (one was left to drain for an earlier request that waited longer)" if held else ""
                raise Overloaded(f"every replica that could take it is full{why}; retry later",
                                 max(1.0, backoff * 10), reason="queue_timeout")
            # each wait ends at once when the client leaves (raised at the loop's top)
            if busy:  # a worker at its call cap, or an earlier attempt's abort on its way: not a wait for room
                request.cancel.wait(backoff)
            else:  # ... and this one when the request goes first after another was placed
                self.room.refused(rid, frozenset(refused - hold))  # held for it once it goes first
                self.room.wait(rid, admitted, backoff, request.cancel)
            backoff = min(backoff * 2, 0.2)
            self.view.invalidate()

    def _with_stall_bound(self, request: WorkerRequest, selection: Selection, lost: set[str]) -> WorkerRequest:
        """``request`` with ``scheduler.max_stall_s`` when another decode replica could take it if this one
        stalls (its request waiting there, preempted); else unbounded: with nowhere to go, it waits there
        (up to its request timeout) rather than fail."""
        if request.prefill_only and not self.colocated:  # its one token is prefill's: nothing streams
            return request
        mine = selection.decode.worker_id
        if any(c.worker_id != mine for c in self._routable("decode", lost)):
            return dataclasses.replace(request, max_stall_s=self.settings.max_stall_s)
        return request

    def _routable(self, pool: str, lost: set[str]) -> list[Candidate]:
        """The pool's live workers this request has not lost and whose circuit breaker lets them be routed."""
        return [c for c in self.selector.candidates(pool)
                if c.worker_id not in lost and self.health.routable(c.worker_id)]

    def _no_decode_replica(self, candidates: list[Candidate], lost: set[str]) -> str:
        """Why no decode replica can take a request: none live, every one draining, or every live one lost
        by this request or suspect (its circuit breaker open)."""
        if candidates:
            gone = sum(c.worker_id in lost for c in candidates)
            return (f"no decode replica can take the request: of {len(candidates)} live, {gone} failed it and "
                    f"{len(candidates) - gone} are suspect (recent failures; routed again once a probe succeeds)")
        draining = self.view.draining("decode")
        if draining:
            return (f"every decode replica is draining ({draining}): none takes new work; put one back with "
                    f"`epd drain --undo WORKER` or scale the decode pool up")
        return "no live decode replica to serve the request"

    def _relay(self, rid: str, attempt: Attempt, progress: Progress) -> Iterator[Chunk]:
        """The attempt's chunks as the client's, until the request finished; _Lost when a worker was lost,
        _Refused when draining workers refused it before it streamed."""
        streamed = False
        try:
            for wire in attempt.chunks():
                streamed = True
                chunk = progress.accept(wire)
                if chunk is not None:
                    yield chunk
                if progress.finished:  # a stop string the relay found ends it; closing the attempt aborts it
                    return
        except DispatchError as exc:
            if exc.refused and not streamed:
                raise _Refused(exc, attempt.selection) from None
            if verdict(exc, started=True) is Verdict.LOST:
                raise _Lost(exc, attempt.selection) from None
            self._record(rid, RequestState.FAILED, f"{exc.stage}: {exc.message}")
            raise backend_error(exc) from None
        except GeneratorExit:  # the ingress closed the stream: the client went away
            self._record(rid, RequestState.ABORTED, "the client went away")
            raise
        except ClientGone:  # recorded by generate
            raise
        except BaseException as exc:
            self._record(rid, RequestState.FAILED, f"internal error: {type(exc).__name__}")
            raise
