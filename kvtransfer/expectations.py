"""Bookkeeping shared by both receivers (KV and embeddings): which request ids may push, until when,
and the guarantee that each one's ``on_done`` runs exactly once, success or failure."""

from __future__ import annotations

import enum
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import grpc

from kvtransfer.errors import TransferRefused, detached, fresh

log = logging.getLogger(__name__)
Code = grpc.StatusCode
# How long after a push failed from outside its stream (expired, cancelled) the stream is woken if it still
# waits for its sender: a sender that sends within this learns why from the refusal; a silent one no longer
# holds a receiver thread and stream slot for good.
WAKE_AFTER_S = 5.0
# The longest request id a push may name (the control plane sends uuids, 36). Longer ones are refused by
# length, not echoed: a status message of more than 16 KiB is replaced by gRPC's own "metadata size" error.
MAX_REQUEST_ID_CHARS = 256


def shown_id(request_id: str) -> str:
    """``request_id`` as a refusal message quotes it: cut to MAX_REQUEST_ID_CHARS."""
    return repr(request_id if len(request_id) <= MAX_REQUEST_ID_CHARS else request_id[:MAX_REQUEST_ID_CHARS] + "...")
OutcomeT = TypeVar("OutcomeT")


class State(enum.Enum):
    EXPECTED = "expected"
    STREAMING = "streaming"
    COMPLETE = "complete"
    FAILED = "failed"


@dataclass(eq=False)
class Expected(Generic[OutcomeT]):
    request_id: str
    deadline: float
    on_done: Callable[[OutcomeT], None]
    target: Any  # what the push lands in: reserved blocks, an embedding buffer
    state: State = State.EXPECTED
    lock: threading.Lock = field(default_factory=threading.Lock)  # held while writing into ``target``
    failure: TransferRefused | None = None
    # Set by the stream that claimed it: ends that stream (WAKE_AFTER_S) after the push failed from outside
    # it (expired, cancelled), so a stream waiting on a silent sender lets go of its thread and slot.
    wake: Callable[[TransferRefused], object] | None = None


class Expectations(Generic[OutcomeT]):
    def __init__(self, failed_outcome: Callable[[str, TransferRefused], OutcomeT],
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._failed_outcome = failed_outcome
        self.clock = clock
        self._items: dict[str, Expected[OutcomeT]] = {}
        self._lock = threading.Lock()
        self._janitor: threading.Thread | None = None
        self._stop = threading.Event()
        self._wakes: list[tuple[float, Expected[OutcomeT], TransferRefused]] = []  # (when, stream, why)

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, request_id: object) -> bool:
        """Whether ``request_id`` is expected or streaming (not yet done)."""
        with self._lock:
            return request_id in self._items

    def add(self, request_id: str, target: Any, on_done: Callable[[OutcomeT], None], timeout_s: float) -> None:
        with self._lock:
            if request_id in self._items:
                raise ValueError(f"request {request_id!r} is already expected")
            self._items[request_id] = Expected(request_id, self.clock() + timeout_s, on_done, target)

    def retarget(self, request_id: str, target: Any) -> bool:
        """Point a push that no stream has claimed yet at another ``target``; False (nothing changes) when
        ``request_id`` is not expected, or a stream has claimed it."""
        with self._lock:
            exp = self._items.get(request_id)
            if exp is None:
                return False
            with exp.lock:
                if exp.state is not State.EXPECTED:
                    return False
                exp.target = target
                return True

    def claim(self, request_id: str, wake: Callable[[TransferRefused], object] | None = None) -> Expected[OutcomeT]:
        """Bind a stream to ``request_id``; refuses unknown ids and a second stream. ``wake(failure)`` is
        called (by ``sweep``, WAKE_AFTER_S later) if the push then fails from outside the stream: expired
        or cancelled; by ``stop`` at once. Waking a stream that has ended must do nothing."""
        if len(request_id) > MAX_REQUEST_ID_CHARS:
            raise TransferRefused(Code.INVALID_ARGUMENT, f"request_id is {len(request_id)} characters long; at "
                                                         f"most {MAX_REQUEST_ID_CHARS}")
        with self._lock:
            exp = self._items.get(request_id)
            if exp is None:
                raise TransferRefused(Code.NOT_FOUND, f"no reservation for request {request_id!r} "
                                                      "(never made, expired or already used)")
            with exp.lock:
                if exp.state is not State.EXPECTED:
                    raise TransferRefused(Code.ALREADY_EXISTS, f"request {request_id!r} already has a stream")
                exp.state = State.STREAMING
                exp.wake = wake
        return exp

    def complete(self, exp: Expected[OutcomeT], outcome: OutcomeT) -> None:
        with exp.lock:
            if exp.state is not State.STREAMING:
                raise fresh(exp.failure) if exp.failure else TransferRefused(Code.CANCELLED, "transfer cancelled")
            exp.state = State.COMPLETE
        with self._lock:
            self._items.pop(exp.request_id, None)
        exp.on_done(outcome)

    def fail(self, exp: Expected[OutcomeT], err: TransferRefused) -> bool:
        with exp.lock:  # never while a chunk is being written into the target
            if exp.state in (State.COMPLETE, State.FAILED):
                return False
            exp.state = State.FAILED
            exp.failure = detached(err)  # kept: its traceback would hold this push's state in a cycle
        with self._lock:
            self._items.pop(exp.request_id, None)
        log.info("transfer %s failed: %s %s", exp.request_id, err.code.name, err.message)
        exp.on_done(self._failed_outcome(exp.request_id, err))
        return True

    def cancel(self, request_id: str, reason: str) -> bool:
        exp = self._items.get(request_id)
        return exp is not None and self._fail_from_outside(exp, TransferRefused(Code.CANCELLED, reason))

    def sweep(self) -> list[str]:
        """Fail the expectations past their deadline (their ids), and wake the streams whose wait is up."""
        now = self.clock()
        late = [e for e in list(self._items.values()) if e.deadline <= now]
        failed = [e.request_id for e in late
                  if self._fail_from_outside(e, TransferRefused(Code.DEADLINE_EXCEEDED,
                                                                f"transfer for {e.request_id!r} did not complete "
                                                                f"in time"))]
        self._wake(now)
        return failed

    def _fail_from_outside(self, exp: Expected[OutcomeT], err: TransferRefused) -> bool:
        """``fail``; the stream bound to it (if one is) is woken WAKE_AFTER_S later."""
        if not self.fail(exp, err):
            return False
        if exp.wake is not None:
            with self._lock:
                self._wakes.append((self.clock() + WAKE_AFTER_S, exp, err))
        return True

    def _wake(self, now: float) -> None:
        """Wake the streams due by ``now`` (every one for ``math.inf``)."""
        with self._lock:
            due = [w for w in self._wakes if w[0] <= now]
            self._wakes = [w for w in self._wakes if w[0] > now]
        for _, exp, err in due:
            assert exp.wake is not None
            try:
                exp.wake(err)
            except Exception:  # a stream that ended meanwhile: nothing to wake
                log.debug("waking the stream of %s failed", exp.request_id, exc_info=True)

    def start_janitor(self, interval_s: float = 0.05, also: Callable[[], None] | None = None) -> None:
        def loop() -> None:
            while not self._stop.wait(interval_s):
                self.sweep()
                if also is not None:
                    also()
        self._janitor = threading.Thread(target=loop, name="transfer-janitor", daemon=True)
        self._janitor.start()

    def stop(self) -> None:
        self._stop.set()
        if self._janitor is not None:
            self._janitor.join(timeout=2)
        for exp in list(self._items.values()):
            self._fail_from_outside(exp, TransferRefused(Code.UNAVAILABLE, "the receiver is shutting down"))
        self._wake(math.inf)


def refusal(expectations: Expectations, bound: list, exc: Exception) -> TransferRefused:
    """What a push that raised ``exc`` is refused with, after failing its expectation (``bound[0]``, once
    the handshake claimed it): a refusal as raised, unless the expectation had already failed (the first
    failure wins); anything else is a bug, logged and answered INTERNAL while the others carry on. What it
    returns carries no traceback: the caller's frame holds it, and the traceback that frame (a cycle)."""
    if isinstance(exc, TransferRefused):
        exc = detached(exc)
        if bound:
            expectations.fail(bound[0], exc)
            return bound[0].failure or exc
        return exc
    log.exception("transfer receiver error")
    if bound:
        expectations.fail(bound[0], TransferRefused(Code.INTERNAL, f"receiver error: {exc}"))
    return TransferRefused(Code.INTERNAL, f"receiver error: {type(exc).__name__}")


def run_stream(expectations: Expectations, context: grpc.ServicerContext, body: Callable[[list], bytes]) -> bytes:
    """Run a push handler body; map refusals to statuses and fail the bound expectation (held in
    ``bound[0]`` once the handshake claims it) on any error."""
    bound: list[Expected] = []
    try:
        return body(bound)
    except grpc.RpcError as exc:  # the client cancelled or disconnected mid-stream: nobody reads an answer
        # grpc's server keeps each RpcError its request iterator raises (on the call's state, which the context
        # holds), and the traceback holds this stream's frames, which hold the context: a reference cycle that
        # kept the push's state until a full collection. Detached, and not raised on (which would give it a
        # traceback through these frames again).
        detached(exc)
        if bound:
            expectations.fail(bound[0], TransferRefused(Code.CANCELLED, "the sender cancelled or went away"))
        return b""
    except Exception as exc:
        err = refusal(expectations, bound, exc)
        context.abort(err.code, err.message)
    raise AssertionError("unreachable: context.abort raises")
