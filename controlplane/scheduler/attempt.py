"""One attempt: a request's run on one route, from the first worker call to its last chunk.

``Attempt.open`` charges the route's workers in the view (so the next pick sees them: the prompt on each,
less what the routing policy guessed it caches, and in KV blocks on the decode worker), starts the dispatch
and waits for the first chunk (the decode reservation is made before it). With the first chunk the prefill
and encode workers are done, and their charges go back; the decode worker's grows by each token it streams.
The attempt is a context manager: on every exit (finished, failed, the client gone, an interrupt) it closes
the dispatch (which aborts the request on every worker it touched) and gives each charge and count back
exactly once. An ``open`` that raises has already given everything back.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Generator, Iterator
from types import TracebackType

from controlplane.dispatch import Dispatcher, WorkerRequest
from controlplane.scheduler.health import WorkerHealth
from controlplane.scheduler.selection import Selection
from controlplane.scheduler.worker_view import Charge, WorkerView
from epd.worker.v1 import worker_pb2 as wpb


class Attempt:
    def __init__(self, view: WorkerView, health: WorkerHealth, selection: Selection, tokens: int) -> None:
        self.view = view
        self.health = health
        self.selection = selection
        self.tokens = tokens  # prompt tokens, as counted in the view
        self._stream: Generator[wpb.TokenChunk, None, None] | None = None
        self._first: wpb.TokenChunk | None = None
        self._held = False
        self._charges: list[Charge] = []  # decode first

    @classmethod
    def open(cls, view: WorkerView, health: WorkerHealth, dispatcher: Dispatcher, selection: Selection,
             request: WorkerRequest, timeout_s: float, on_started: Callable[[], None] = lambda: None) -> Attempt:
        """Start ``request`` on ``selection`` with ``timeout_s`` as every call's deadline; DispatchError
        (everything given back) when it fails before its first chunk. ``on_started``: ``Dispatcher.run``'s,
        called once the workers hold the request (before its first token, which comes after prefill)."""
        attempt = cls(view, health, selection, len(request.prompt_ids))
        attempt._take()
        try:
            attempt._stream = dispatcher.run(dataclasses.replace(request, timeout_s=timeout_s), selection.route,
                                             on_started)
            attempt._first = next(attempt._stream)  # reserve happens before the first chunk
            for charge in attempt._charges[1:]:  # prefill and encode computed theirs
                charge.release()
        except BaseException:
            attempt.close()
            raise
        return attempt

    def _take(self) -> None:
        decode = self.selection.decode
        for c in self.selection.workers:
            # what a worker's prefix cache likely holds it neither computes nor takes new blocks for
            self._charges.append(self.view.begin(c.worker_id, self.tokens - c.cached_tokens, kv=c is decode))
            self.health.begin(c.worker_id)
        self._held = True

    def chunks(self) -> Iterator[wpb.TokenChunk]:
        """The attempt's chunks from the first; DispatchError when a stage fails."""
        assert self._stream is not None and self._first is not None
        first, self._first = self._first, None
        held = self._charges[0]  # the decode worker's KV: each token streamed is held there too
        held.grow(len(first.token_ids))
        yield first
        for chunk in self._stream:
            held.grow(len(chunk.token_ids))
            yield chunk

    def close(self) -> None:
        """Abort what is still running and give the counts back; idempotent."""
        stream, self._stream = self._stream, None
        try:
            if stream is not None:
                stream.close()  # generator close: the dispatch's finally aborts it on its workers
        finally:
            if self._held:
                self._held = False
                for charge in self._charges:
                    charge.release()
                for c in self.selection.workers:
                    self.health.end(c.worker_id)

    def __enter__(self) -> Attempt:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()
