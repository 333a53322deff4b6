"""Drives an engine on its own thread and hands each request's outputs to whoever waits for them.

A worker's gRPC handlers run on many threads; the engine must be stepped by one. ``EngineLoop``
owns that thread: handlers ``submit`` (or ``adopt`` a transferred prompt) and get a queue that
receives the request's ``RequestOutput``s, ending with the finished one. ``abort`` drops a
request and frees its blocks. When the engine has nothing to do the thread sleeps until new work
arrives. The loop never dies with a request: an engine error fails every request it held.

New work goes through a mailbox that the loop thread empties between steps, so a handler never
waits for a step to end (the engine holds its lock for the whole step): everything that arrived
during a step joins the next one together, which is what lets concurrent prompts batch.

One thread steps at a time, not always the loop's: a handler that finds the loop idle may step its own
request on its own thread (``run_here``), saving the two thread wake-ups of the hand-off; a lock
(``_cycle_lock``) keeps admission and steps to one thread at a time either way.
"""

from __future__ import annotations

import dataclasses
import logging
import queue
import threading
import time
from dataclasses import dataclass

from workers.runtime.engine import Engine, KVReservation, RequestOutput
from workers.runtime.errors import DuplicateRequestError, EngineError
from workers.runtime.sampler import SamplingParams, TokenLogprobs
from workers.runtime.sequence import FinishReason, MultimodalInput

log = logging.getLogger(__name__)

IDLE_POLL_S = 0.05  # an idle loop looks for work this often even when nothing wakes it


@dataclass(frozen=True)
class LoopFailure:
    """Put on a request's queue when the engine refused it (``error`` set) or failed while running it."""

    message: str
    error: EngineError | None = None


@dataclass(frozen=True)
class _Add:
    request_id: str
    prompt_ids: list[int]
    params: SamplingParams
    mm: MultimodalInput | None


@dataclass(frozen=True)
class _Adopt:
    reservation: KVReservation
    prompt_ids: list[int]
    first_token: int
    params: SamplingParams
    first_logprobs: TokenLogprobs | None = None


_Work = _Add | _Adopt


class EngineLoop:
    def __init__(self, engine: Engine, name: str = "engine-loop") -> None:
        self.engine = engine
        self._queues: dict[str, queue.Queue] = {}
        self._inbox: dict[str, _Work] = {}  # request id -> work the loop has not taken yet (insertion order)
        self._admitted: dict[str, float] = {}  # request id -> perf_counter() at admission (_cycle_lock holder)
        self._cycle_lock = threading.Lock()  # one thread admits and steps at a time (see run_here)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._ticked = time.monotonic()  # when the loop last ended a cycle or an idle wait, on whichever thread
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               mm: MultimodalInput | None = None, wake: bool = True) -> queue.Queue:
        """Queue a request; outputs arrive on the returned queue. Raises the EngineError of a request the
        engine would refuse; one it refuses later (a duplicate id) gets a ``LoopFailure`` with the error.
        ``wake=False``: the caller calls ``run_here`` next (which wakes the loop if it cannot serve it)."""
        self.engine.check_request(prompt_ids, params, mm)
        return self._post(request_id, _Add(request_id, list(prompt_ids), params, mm), wake)

    def adopt(self, reservation: KVReservation, prompt_ids: list[int], first_token: int,
              params: SamplingParams, first_logprobs: TokenLogprobs | None = None) -> queue.Queue:
        """Join a transferred prompt; its first output (prefill's token) is the first on the queue. A
        refusal arrives as a ``LoopFailure`` with the error; the reservation is consumed either way."""
        try:
            return self._post(reservation.request_id, _Adopt(reservation, list(prompt_ids), first_token, params,
                                                             first_logprobs))
        except EngineError:
            self.engine.release(reservation)
            raise

    def _post(self, request_id: str, work: _Work, wake: bool = True) -> queue.Queue:
        q: queue.Queue = queue.Queue()
        with self._lock:
            if request_id in self._queues:
                raise DuplicateRequestError(f"request id {request_id!r} is already in the engine")
            self._queues[request_id] = q
            self._inbox[request_id] = work
        if wake:
            self._wake.set()
        return q

    def abort(self, request_id: str) -> bool:
        """Drop the request; whoever waits on its queue gets a finished ABORT output."""
        with self._lock:
            q = self._queues.pop(request_id, None)
            work = self._inbox.pop(request_id, None)
        if isinstance(work, _Adopt):
            self.engine.release(work.reservation)
        found = self.engine.abort(request_id) or work is not None
        if q is not None:
            q.put(RequestOutput(request_id, (), "", True, FinishReason.ABORT, 0, 0))
        return found

    @property
    def active(self) -> int:
        return len(self._queues)

    def quiet_for(self) -> float:
        """Seconds since the loop last ended a cycle (admission, a step, its outputs handed out) or an idle
        wait (every ``IDLE_POLL_S``); infinite once the loop thread has ended. A keepalive is sent only
        while this is short: it proves the engine moves, not just the thread that sends it. A step that
        runs long, or a loop blocked on the engine's lock, reads as quiet."""
        if not self._thread.is_alive():
            return float("inf")
        return time.monotonic() - self._ticked

    def holds(self, request_id: str) -> bool:
        """The request is in the engine or on its way there (its outputs are still to come)."""
        return request_id in self._queues

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _admit(self) -> None:
        """Give the engine what arrived since the last step (by the ``_cycle_lock`` holder, between steps)."""
        with self._lock:
            work, self._inbox = list(self._inbox.values()), {}
        now = time.perf_counter()
        for w in work:
            rid = w.request_id if isinstance(w, _Add) else w.reservation.request_id
            self._admitted[rid] = now
            first = None
            try:
                if isinstance(w, _Add):
                    self.engine.add_request(rid, w.prompt_ids, w.params, w.mm)
                else:
                    first = self.engine.add_prefilled(w.reservation, w.prompt_ids, w.first_token, w.params,
                                                      w.first_logprobs)
            except EngineError as exc:
                with self._lock:
                    q = self._queues.pop(rid, None)
                if q is not None:
                    q.put(LoopFailure(str(exc), exc))
                continue
            if first is not None and first.finished:
                first = self._timed(first)
            with self._lock:
                q = self._queues.get(rid)
                if q is not None and first is not None:
                    q.put(first)
                    if first.finished:
                        del self._queues[rid]
            if q is None:  # aborted while it was being admitted
                self._admitted.pop(rid, None)
                self.engine.abort(rid)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._cycle_lock:
                busy = self._cycle()
            if not busy:
                self._wake.wait(IDLE_POLL_S)
                self._wake.clear()
                self._ticked = time.monotonic()

    def _cycle(self) -> bool:
        """Admit what arrived, then one engine step and its outputs handed out. Run by whoever holds
        ``_cycle_lock`` (the loop thread, or a caller in ``run_here``). False: nothing to step, or nothing
        could run this step."""
        if self._inbox:
            self._admit()
        if not self.engine.has_unfinished():
            return False
        steps = self.engine.stats().steps
        try:
            outputs = self.engine.step()
        except Exception as exc:  # a bug in the engine: fail what it held, keep the loop alive
            log.exception("engine step failed")
            self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
            return False
        outputs = [self._timed(o) if o.finished else o for o in outputs]
        with self._lock:
            for out in outputs:
                q = self._queues.get(out.request_id)
                if q is None:
                    continue
                q.put(out if out.error is None else LoopFailure(str(out.error), out.error))
                if out.finished:
                    del self._queues[out.request_id]
        if len(self._admitted) > len(self._queues) + 64:  # aborted requests' entries
            with self._lock:
                live = set(self._queues)
            self._admitted = {rid: t for rid, t in self._admitted.items() if rid in live}
        self._ticked = time.monotonic()
        # nothing could run (a preempted sequence waits for blocks that reservations hold): not busy, so the
        # loop waits for a wake-up or its poll instead of spinning on the engine's lock
        return self.engine.stats().steps != steps

    def run_here(self, request_id: str) -> None:
        """Step the engine on the calling thread until ``request_id`` finishes, if the loop is idle.

        A one-token request on an idle worker then costs no thread hand-off: the handler that submitted
        it admits it, steps it and finds its output on its queue, instead of waking the loop thread and
        being woken by it (two thread wake-ups saved). Anything else that
        arrives meanwhile joins the same steps (it is admitted from the same inbox). When the loop is busy
        (a step running) this returns at once and the loop thread serves the request as usual; when this
        returns with work left, the loop thread is woken to carry on."""
        if not self._cycle_lock.acquire(blocking=False):
            self._wake.set()
            return
        try:
            while request_id in self._queues and not self._stop.is_set():
                if not self._cycle():
                    break
        finally:
            self._cycle_lock.release()
            if self._inbox or self.engine.has_unfinished():
                self._wake.set()

    def _timed(self, out: RequestOutput) -> RequestOutput:
        """A finished output with its request's engine time (admission -> now)."""
        t0 = self._admitted.pop(out.request_id, None)
        return out if t0 is None else dataclasses.replace(out, engine_seconds=time.perf_counter() - t0)

    def _fail_all(self, message: str) -> None:
        self._admitted.clear()
        with self._lock:
            queues, self._queues = self._queues, {}
            inbox, self._inbox = self._inbox, {}
        for w in inbox.values():
            if isinstance(w, _Adopt):
                self.engine.release(w.reservation)
        for rid in queues:
            self.engine.abort(rid)
        for q in queues.values():
            q.put(LoopFailure(message))


def drain_outputs(q: queue.Queue, timeout_s: float) -> list[RequestOutput]:
    """Collect a request's outputs until it finishes (tests and the reference client)."""
    outs: list[RequestOutput] = []
    while True:
        item = q.get(timeout=timeout_s)
        if isinstance(item, LoopFailure):
            raise RuntimeError(item.message)
        outs.append(item)
        if item.finished:
            return outs
