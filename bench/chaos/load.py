"""The load driver: ``concurrency`` threads sending a workload's requests, closed loop or at a steady rate.

A closed loop of ``concurrency`` threads (or, with ``rate``, arrivals at that many requests per second)
asks the workload (``bench/chaos/workload.py``) to send its n-th request, and keeps one ``Outcome`` per
request: its wall-clock start and end, HTTP status, error text (empty when the request ended as its kind
expects), whether its text equals ``generate()``'s (for kinds with a reference), and the request's journal id.
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass, replace
from typing import Protocol

import httpx


@dataclass(frozen=True)
class Outcome:
    start: float  # time.monotonic()
    end: float
    status: int  # HTTP status; 0: no answer (connection error, timeout, or the client closed it on purpose)
    error: str  # why the request did not end as its kind expects; "" when it did
    match: bool  # the text equals the reference exactly (False where the kind has none)
    request_id: str  # the journal's id ("" when unknown)
    kind: str = "greedy"
    checked: bool = True  # the kind has a reference, so ``match`` means something
    retry_after_s: float = 0.0  # a 429 ("full; retry later"): its Retry-After; else 0
    retries: int = 0  # 429s this request got (and waited out) before this outcome

    @property
    def ok(self) -> bool:
        return not self.error

    @property
    def latency(self) -> float:
        return self.end - self.start


def journal_id(response_id: str) -> str:
    """``cmpl-<32 hex>`` -> the request's uuid as the journal keys it."""
    h = response_id.rsplit("-", 1)[-1]
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" if len(h) == 32 else ""


class Workload(Protocol):
    def send(self, client: httpx.Client, n: int) -> Outcome:
        """Send request number ``n`` (each n once, from any thread) and judge how it ended."""
        ...


class LoadDriver:
    def __init__(self, workload: Workload, concurrency: int, rate: float | None = None,
                 timeout_s: float = 120.0, retries_on_429: int = 0) -> None:
        """``retries_on_429``: send a request again, after its Retry-After, when it was answered 429, at most
        that many times (as an OpenAI client does); 0 = a 429 is the request's outcome."""
        self.workload, self.concurrency, self.rate, self.timeout_s = workload, concurrency, rate, timeout_s
        self.retries_on_429 = retries_on_429
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._next = itertools.count()
        self._threads: list[threading.Thread] = []

    def start(self) -> LoadDriver:
        target = self._open_loop if self.rate else self._closed_loop
        self._threads = [threading.Thread(target=target, args=(i,), daemon=True) for i in range(self.concurrency)]
        for t in self._threads:
            t.start()
        return self

    def stop(self, join_s: float = 180.0) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(join_s)

    @property
    def count(self) -> int:
        return len(self.outcomes)

    def _closed_loop(self, _: int) -> None:
        with httpx.Client(timeout=self.timeout_s) as client:
            while not self._stop.is_set():
                self._one(client)

    def _open_loop(self, lane: int) -> None:
        """Lane ``lane`` of ``concurrency`` sends every concurrency-th arrival of a steady ``rate``."""
        assert self.rate
        began = time.monotonic()
        with httpx.Client(timeout=self.timeout_s) as client:
            for k in itertools.count(lane, self.concurrency):
                wait = began + k / self.rate - time.monotonic()
                if self._stop.wait(max(0.0, wait)):
                    return
                self._one(client)

    def _one(self, client: httpx.Client) -> None:
        n = next(self._next)
        out = self.workload.send(client, n)
        tries = 0
        while out.status == 429 and tries < self.retries_on_429:
            if self._stop.wait(out.retry_after_s):
                return  # the run ended while this request waited to be sent again: cut short, not failed
            tries += 1
            again = self.workload.send(client, n)
            out = replace(again, start=out.start, retries=tries)
        with self._lock:
            self.outcomes.append(out)
