"""The dispatcher's connections to its workers: per worker address one keepalive channel (never one per
call), one stub of each kind on it (building a stub makes a callable per RPC of its service, work a call
need not repeat), the address's call slots, and when all of it is let go.

An address's entry, from the first call to it:
  1. OPEN     calls share its channel; at most ``max_calls`` of them hold a call slot at once.
  2. RETIRED  ``forget``: the worker is gone for good. While a call is in flight on it the entry stays:
              closing the channel would cancel that call's stream, which the dispatcher would see as
              CANCELLED rather than the broken stream (UNAVAILABLE) it migrates the request on. A call
              that starts meanwhile shares the entry, its channel and its slots.
  3. CLOSED   no call in flight on a retired entry (at ``forget``, or when its last call ends): it leaves
              the table and its channel is closed. A later call to the address opens a new entry.
A call counts from ``take`` (or ``use``) until its slot is given back and every ``hold`` on it is let
go, all under one lock, so an entry is never closed under a call that started before or after ``forget``.

The last ``GONE_KEPT`` forgotten addresses are remembered: a new entry for one of them (a request routed
on a snapshot that still lists the gone worker, an abort sent after the fact) is born retired, so it is
closed when its call ends instead of staying open for good. So is an entry a ``use`` opens (an abort to
an address no call holds). ``serving`` says an address serves again (a new worker on a reused port): its
entry, if any, is no longer retired and new ones are not.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, TypeVar, cast

import grpc

from controlplane.dispatch_watch import keepalive_options
from kvtransfer.auth import TransferSecurity
from kvtransfer.options import CHANNEL_OPTIONS

GONE_KEPT = 1024  # forgotten addresses remembered (a set's worth of memory, bounded under any churn)

_Stub = TypeVar("_Stub")


@dataclass(frozen=True)
class WorkerCalls:
    """One worker address as the dispatcher holds it: ``calls`` in flight on it (slots held, and calls
    outlasting their slot), ``slots_taken`` of its cap, ``retired``: forgotten, closed when ``calls`` is 0."""

    address: str
    calls: int
    slots_taken: int
    retired: bool


class Worker:
    """One address's entry: its channel and stubs. Counts change only under its ``WorkerChannels``' lock."""

    __slots__ = ("address", "channel", "stubs", "calls", "taken", "retired")

    def __init__(self, address: str, channel: grpc.Channel, retired: bool) -> None:
        self.address, self.channel, self.retired = address, channel, retired
        self.stubs: dict[Callable[[grpc.Channel], Any], Any] = {}
        self.calls = 0
        self.taken = 0

    def stub(self, kind: Callable[[grpc.Channel], _Stub]) -> _Stub:
        """``kind`` (a generated ``...Stub`` class) over this entry's channel, made once."""
        stub = self.stubs.get(kind)  # no lock: a dict read, and setdefault keeps the first one made
        if stub is None:
            stub = self.stubs.setdefault(kind, kind(self.channel))
        return cast(_Stub, stub)


class Slot:
    """A taken call slot on ``worker`` (None: no worker, nothing taken). ``release`` gives the slot back and
    ends its call once, however often it is called."""

    __slots__ = ("_owner", "worker", "_lock")

    def __init__(self, owner: WorkerChannels | None, worker: Worker | None) -> None:
        self._owner, self.worker = owner, worker
        self._lock = threading.Lock()

    def stub(self, kind: Callable[[grpc.Channel], _Stub]) -> _Stub:
        assert self.worker is not None, "no worker behind this slot"
        return self.worker.stub(kind)

    def end_with(self, future: Future, *first: Callable[[Future], object]) -> None:
        """The slot's call is ``future``'s: once it is done, the callbacks ``first`` run, then the slot is
        given back. The call counts on the worker until then even if the slot is given back earlier (the
        request ended while the call still runs). Call it while the slot is held."""
        owner, worker = self._owner, self.worker
        if owner is not None and worker is not None:
            owner.hold(worker)
        for callback in first:
            future.add_done_callback(callback)
        future.add_done_callback(lambda _f: self.release())
        if owner is not None and worker is not None:
            future.add_done_callback(lambda _f: owner.done(worker))

    def release(self) -> None:
        with self._lock:
            owner, self._owner = self._owner, None
        if owner is not None and self.worker is not None:
            owner.give(self.worker)


class WorkerChannels:
    def __init__(self, security: TransferSecurity, keepalive_s: float, max_calls: int) -> None:
        """``max_calls``: call slots per address (the workers' stream budget)."""
        self.security = security
        self.options = CHANNEL_OPTIONS + keepalive_options(keepalive_s)
        self.max_calls = max_calls
        self._workers: dict[str, Worker] = {}
        self._gone: OrderedDict[str, None] = OrderedDict()  # recently forgotten addresses, oldest first
        self._lock = threading.Lock()

    def _entry(self, address: str, retired: bool) -> Worker:
        """``address``'s entry, opened (``retired`` or not) if it has none. Under the lock."""
        w = self._workers.get(address)
        if w is None:
            channel = self.security.open_channel(address, self.options)
            w = self._workers[address] = Worker(address, channel, retired or address in self._gone)
        return w

    def take(self, address: str) -> Slot | None:
        """A call slot on ``address``, or None when all ``max_calls`` are taken."""
        with self._lock:
            w = self._entry(address, retired=False)
            if w.taken >= self.max_calls:
                return None
            w.taken += 1
            w.calls += 1
        return Slot(self, w)

    def use(self, address: str) -> Worker:
        """``address``'s entry for one call that takes no slot (an abort); end it with ``done``. An address
        no call holds gets an entry born retired: closed again when the call ends."""
        with self._lock:
            w = self._entry(address, retired=True)
            w.calls += 1
        return w

    def hold(self, w: Worker) -> None:
        """One more call on ``w``, which a call in flight keeps open; end it with ``done``."""
        with self._lock:
            w.calls += 1

    def give(self, w: Worker) -> None:
        """A slot's call ended: its slot back, and ``done``."""
        self.done(w, slot=True)

    def done(self, w: Worker, *, slot: bool = False) -> None:
        """A call on ``w`` ended (``slot``: and gave its slot back); the last one on a retired entry closes it."""
        with self._lock:
            w.taken -= slot
            w.calls -= 1
            if w.calls > 0 or not w.retired:
                return
            if self._workers.get(w.address) is w:
                del self._workers[w.address]
        w.channel.close()

    def forget(self, address: str) -> None:
        """The worker at ``address`` is gone for good: its entry is closed now, or when its last call ends."""
        with self._lock:
            self._gone[address] = None
            self._gone.move_to_end(address)
            while len(self._gone) > GONE_KEPT:
                self._gone.popitem(last=False)
            w = self._workers.get(address)
            if w is None:
                return
            w.retired = True
            if w.calls > 0:
                return
            del self._workers[address]
        w.channel.close()

    def serving(self, address: str) -> None:
        """A worker serves at ``address`` (again): its entry stays open."""
        with self._lock:
            self._gone.pop(address, None)
            w = self._workers.get(address)
            if w is not None:
                w.retired = False

    def held(self) -> tuple[WorkerCalls, ...]:
        """Every address with an entry, in address order."""
        with self._lock:
            return tuple(WorkerCalls(w.address, w.calls, w.taken, w.retired)
                         for _, w in sorted(self._workers.items()))

    def close(self) -> None:
        """Close every channel (calls in flight on them end CANCELLED): the dispatcher's shutdown."""
        with self._lock:
            workers, self._workers = list(self._workers.values()), {}
        for w in workers:
            w.channel.close()
