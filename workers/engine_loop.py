"""Drives an engine on its own thread and hands each request's outputs to whoever waits for them.

A worker's gRPC handlers run on many threads; the engine must be stepped by one. ``EngineLoop``
owns that thread: handlers ``submit`` (or ``adopt`` a transferred prompt) and get a queue that
receives the request's ``RequestOutput``s, ending with the finished one. ``abort`` drops a
request and frees its blocks. When the engine has nothing to do the thread sleeps until new work
arrives. The loop never dies with a request: an engine error fails every request it held.
"""

from __future__ import annotations

import logging
import queue
import threading
from dataclasses import dataclass

from workers.runtime.engine import Engine, KVReservation, RequestOutput
from workers.runtime.sampler import SamplingParams
from workers.runtime.sequence import FinishReason, MultimodalInput

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopFailure:
    """Put on a request's queue when the engine failed while it was running."""

    message: str


class EngineLoop:
    def __init__(self, engine: Engine, name: str = "engine-loop") -> None:
        self.engine = engine
        self._queues: dict[str, queue.Queue] = {}
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, request_id: str, prompt_ids: list[int], params: SamplingParams,
               mm: MultimodalInput | None = None) -> queue.Queue:
        """Queue a request (EngineError if it is refused); outputs arrive on the returned queue."""
        q: queue.Queue = queue.Queue()
        with self._lock:
            self.engine.add_request(request_id, prompt_ids, params, mm)
            self._queues[request_id] = q
        self._wake.set()
        return q

    def adopt(self, reservation: KVReservation, prompt_ids: list[int], first_token: int,
              params: SamplingParams) -> queue.Queue:
        """Join a transferred prompt; its first output (prefill's token) is already on the queue."""
        q: queue.Queue = queue.Queue()
        with self._lock:
            first = self.engine.add_prefilled(reservation, prompt_ids, first_token, params)
            q.put(first)
            if not first.finished:
                self._queues[reservation.request_id] = q
        self._wake.set()
        return q

    def abort(self, request_id: str) -> bool:
        """Drop the request; whoever waits on its queue gets a finished ABORT output."""
        with self._lock:
            q = self._queues.pop(request_id, None)
            found = self.engine.abort(request_id)
        if q is not None:
            q.put(RequestOutput(request_id, (), "", True, FinishReason.ABORT, 0, 0))
        return found

    @property
    def active(self) -> int:
        return len(self._queues)

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stop.set()
        self._wake.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while not self._stop.is_set():
            if not self.engine.has_unfinished():
                self._wake.wait(0.05)
                self._wake.clear()
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a bug in the engine: fail what it held, keep the loop alive
                log.exception("engine step failed")
                self._fail_all(f"engine error: {type(exc).__name__}: {exc}")
                continue
            with self._lock:
                for out in outputs:
                    q = self._queues.get(out.request_id)
                    if q is None:
                        continue
                    q.put(out)
                    if out.finished:
                        del self._queues[out.request_id]

    def _fail_all(self, message: str) -> None:
        with self._lock:
            queues, self._queues = self._queues, {}
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
