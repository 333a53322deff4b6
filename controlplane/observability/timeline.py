"""The dashboard's history: six hours of 10-second slots kept in the control plane's memory.

Each slot counts the HTTP answers on /v1/* (and how many were errors), keeps the deepest queue seen (the
scheduler's waiting requests, and the requests in flight at the ingress), the KV bytes moved, and a bounded
sample of each finished request's latencies (TTFT, TPOT, end to end, and the time in each stage). A view
merges slots into the buckets of a window (5 min, 1 h, 6 h): counts add up, quantiles come from the merged
samples. Memory is bounded: ``SLOTS`` slots of at most ``SAMPLES`` values per latency.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

SLOT_S = 10.0
SLOTS = 6 * 360  # six hours
SAMPLES = 32  # latencies kept per slot and metric: a uniform sample of what it saw (reservoir sampling)
WINDOWS_S = (300, 3600, 21600)  # what the dashboard offers
MAX_BUCKETS = 60  # points per chart: 30 for 5 min (one per slot), 60 for 1 h and 6 h


@dataclass
class Slot:
    start: float  # seconds since the epoch, a multiple of SLOT_S
    answered: int = 0
    errors: int = 0  # answers with status >= 500, or 429 (refused for load)
    client_errors: int = 0  # other 4xx
    waiting_max: int = 0
    in_flight_max: int = 0
    kv_logical_bytes: int = 0
    kv_wire_bytes: int = 0
    samples: dict[str, list[float]] = field(default_factory=dict)  # metric -> seconds
    seen: dict[str, int] = field(default_factory=dict)  # metric -> values offered

    def count_status(self, status: int) -> None:
        if status >= 500 or status == 429:
            self.errors += 1
        elif status >= 400:
            self.client_errors += 1

    def sample(self, metric: str, value: float, rng: random.Random) -> None:
        n = self.seen.get(metric, 0) + 1
        self.seen[metric] = n
        kept = self.samples.setdefault(metric, [])
        if len(kept) < SAMPLES:
            kept.append(value)
        else:
            j = rng.randrange(n)
            if j < SAMPLES:
                kept[j] = value


class Timeline:
    """Thread-safe; ``clock`` is seconds since the epoch (injectable for tests)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self._slots: dict[int, Slot] = {}
        self._lock = threading.Lock()
        self._rng = random.Random(0)

    def _slot(self, now: float) -> Slot:
        key = int(now // SLOT_S)
        slot = self._slots.get(key)
        if slot is None:
            slot = self._slots[key] = Slot(key * SLOT_S)
            for old in [k for k in self._slots if k <= key - SLOTS]:
                del self._slots[old]
        return slot

    def answered(self, status: int) -> None:
        with self._lock:
            slot = self._slot(self.clock())
            slot.answered += 1
            slot.count_status(status)

    def cut_short(self, status: int) -> None:
        """A streamed answer (counted by ``answered`` as its 200) that ended with ``status`` after its
        first token: an error (5xx), or a client error (4xx, 499 when the client left)."""
        with self._lock:
            self._slot(self.clock()).count_status(status)

    def depth(self, waiting: int, in_flight: int) -> None:
        with self._lock:
            slot = self._slot(self.clock())
            slot.waiting_max = max(slot.waiting_max, waiting)
            slot.in_flight_max = max(slot.in_flight_max, in_flight)

    def finished(self, latencies: Iterable[tuple[str, float]], kv_logical_bytes: int = 0,
                 kv_wire_bytes: int = 0) -> None:
        """One request's latencies: (metric, seconds) with metric ttft, tpot, e2e or ``stage:<name>``."""
        with self._lock:
            slot = self._slot(self.clock())
            for metric, seconds in latencies:
                slot.sample(metric, seconds, self._rng)
            slot.kv_logical_bytes += kv_logical_bytes
            slot.kv_wire_bytes += kv_wire_bytes

    def view(self, window_s: int, now: float | None = None) -> dict[str, Any]:
        """Buckets (``window_s / SLOT_S``, at most ``MAX_BUCKETS``) over the last ``window_s`` seconds, oldest
        first: ``t`` (bucket end, epoch
        seconds), requests/s, errors/s (5xx and 429), client errors/s (other 4xx), error % of answers, the
        deepest waiting / in-flight counts, KV MB/s, and p50/p90 of each latency in ms (None: no sample)."""
        now = self.clock() if now is None else now
        n = max(1, min(MAX_BUCKETS, int(window_s // SLOT_S)))
        width = window_s / n
        start = now - window_s
        with self._lock:
            slots = [s for s in self._slots.values() if s.start + SLOT_S > start]
            buckets: list[list[Slot]] = [[] for _ in range(n)]
            for s in slots:
                i = min(n - 1, max(0, int((s.start + SLOT_S / 2 - start) // width)))
                buckets[i].append(s)
            return _series(buckets, start, width)


def _quantile(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    s = sorted(xs)
    pos = q * (len(s) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def _series(buckets: list[list[Slot]], start: float, width: float) -> dict[str, Any]:
    span = width
    out: dict[str, list] = {k: [] for k in ("t", "requests_per_s", "errors_per_s", "client_errors_per_s",
                                            "error_pct", "waiting", "in_flight", "kv_logical_mb_s", "kv_wire_mb_s")}
    latency: dict[str, list] = {}
    metrics = sorted({m for b in buckets for s in b for m in s.samples})
    for i, b in enumerate(buckets):
        answered = sum(s.answered for s in b)
        errors = sum(s.errors for s in b)
        out["t"].append(start + (i + 1) * width)
        out["requests_per_s"].append(answered / span)
        out["errors_per_s"].append(errors / span)
        out["client_errors_per_s"].append(sum(s.client_errors for s in b) / span)
        out["error_pct"].append(100.0 * errors / answered if answered else None)
        out["waiting"].append(max((s.waiting_max for s in b), default=None))
        out["in_flight"].append(max((s.in_flight_max for s in b), default=None))
        out["kv_logical_mb_s"].append(sum(s.kv_logical_bytes for s in b) / span / 1e6)
        out["kv_wire_mb_s"].append(sum(s.kv_wire_bytes for s in b) / span / 1e6)
        for m in metrics:
            xs = [v * 1e3 for s in b for v in s.samples.get(m, ())]
            latency.setdefault(f"{m}_p50_ms", []).append(_quantile(xs, 0.5))
            latency.setdefault(f"{m}_p90_ms", []).append(_quantile(xs, 0.9))
    return {**out, "latency": latency}
