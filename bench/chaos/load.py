"""The steady load: greedy completions of known prompts, each answer checked against its reference.

A closed loop of ``concurrency`` threads (or, with ``rate``, arrivals at that many requests per second)
sends ``/v1/completions`` with the prompt's token ids, ``temperature`` 0 and ``ignore_eos``, and records
one ``Outcome`` per request: its wall-clock start and end, HTTP status, error text, whether the text
equals ``generate()``'s, and the journal id of the request (from the response id).
"""

from __future__ import annotations

import itertools
import threading
import time
from dataclasses import dataclass

import httpx


@dataclass(frozen=True)
class Outcome:
    start: float  # time.monotonic()
    end: float
    status: int  # HTTP status; 0: no answer (connection error, timeout)
    error: str
    match: bool  # the text equals the reference exactly
    request_id: str  # the journal's id ("" when unknown)

    @property
    def ok(self) -> bool:
        return self.status == 200 and not self.error

    @property
    def latency(self) -> float:
        return self.end - self.start


def journal_id(response_id: str) -> str:
    """``cmpl-<32 hex>`` -> the request's uuid as the journal keys it."""
    h = response_id.rsplit("-", 1)[-1]
    return f"{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}" if len(h) == 32 else ""


class LoadDriver:
    def __init__(self, base: str, model: str, prompts: list[list[int]], refs: list[str], max_tokens: int,
                 concurrency: int, rate: float | None = None, timeout_s: float = 120.0) -> None:
        self.base, self.model, self.prompts, self.refs = base, model, prompts, refs
        self.max_tokens, self.concurrency, self.rate, self.timeout_s = max_tokens, concurrency, rate, timeout_s
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
        i = next(self._next) % len(self.prompts)
        body = {"model": self.model, "prompt": self.prompts[i], "max_tokens": self.max_tokens, "temperature": 0,
                "ignore_eos": True}
        start = time.monotonic()
        status, error, match, rid = 0, "", False, ""
        try:
            r = client.post(f"{self.base}/v1/completions", json=body)
            status = r.status_code
            data = r.json()
            if status == 200:
                rid = journal_id(data.get("id", ""))
                match = data["choices"][0]["text"] == self.refs[i]
            else:
                error = str(data.get("error", {}).get("message", data))[:300]
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            error = f"{type(exc).__name__}: {exc}"[:300]
        out = Outcome(start, time.monotonic(), status, error, match, rid)
        with self._lock:
            self.outcomes.append(out)
