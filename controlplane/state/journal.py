"""Request journal: each state change of a request, with its time, for status, debugging and recovery.

A request's life, as recorded (text-only requests skip ENCODING):

1. RECEIVED    the API accepted it
2. QUEUED      waiting for decode capacity
3. ENCODING    the encode pool embeds its images
4. PREFILLING  a prefill worker computes its KV
5. TRANSFERRING  the KV streams to the decode worker
6. DECODING    tokens stream to the client
   MIGRATING   a worker it ran on died or hung; it moves to another (then DECODING again)
7. FINISHED | FAILED | ABORTED

Each request's entries are a Redis list, three elements per entry (state, at, detail), in insertion
order, capped at ``max_entries`` entries, that expires ``retention`` seconds after its last write. The
index of recent requests is a sorted set scored by the last transition time; entries older than
``retention`` and all but the newest ``recent_cap`` are trimmed on every write, and the index itself
expires when nothing is written for ``retention``.

Memory bound: at most ``recent_cap`` requests have a record (a request trimmed from the index by count
has its record deleted with it; one trimmed by age has expired already). A record is the request's
transitions and nothing else (no tokens, no prompt): at most ``max_entries`` entries, each a state, a
time and at most ``MAX_DETAIL`` characters of detail. So the journal holds at most ``recent_cap`` x
``max_entries`` entries; a typical record (a handful of short entries) is a small list, which Redis
stores in a few hundred bytes where a stream took several kilobytes.
"""

from __future__ import annotations

import collections
import enum
import logging
import math
import threading
from dataclasses import dataclass

import redis

from controlplane.state.client import StateConnection

log = logging.getLogger(__name__)

DEFAULT_RETENTION = 3600.0
DEFAULT_RECENT_CAP = 10_000
DEFAULT_MAX_ENTRIES = 64
MAX_DETAIL = 1024


class RequestState(enum.StrEnum):
    RECEIVED = "received"
    QUEUED = "queued"
    ENCODING = "encoding"
    PREFILLING = "prefilling"
    TRANSFERRING = "transferring"
    DECODING = "decoding"
    MIGRATING = "migrating"
    FINISHED = "finished"
    FAILED = "failed"
    ABORTED = "aborted"


@dataclass(frozen=True)
class JournalEntry:
    """One transition: the state entered, when (seconds since the epoch), and a short free-text detail."""

    state: RequestState
    at: float
    detail: str = ""


# KEYS: the index, then one journal key per entry. ARGV: retention ms, max entries per journal, the index's
# cutoff score (entries older than it leave the index), the index's cap, the journal keys' prefix, then per
# entry: request id, state, at, detail. Per entry: RPUSH its three fields and LTRIM the journal to its
# newest max entries, PEXPIRE it, ZADD GT into the index; then the index is trimmed by age (those journals
# have expired already) and by count, deleting the journals it drops, and its expiry renewed. A journal
# left as a stream by an older version is replaced, not appended to (WRONGTYPE).
_RECORD = """
local ret, keep = ARGV[1], -3 * tonumber(ARGV[2])
for i = 2, #KEYS do
  local a = 6 + (i - 2) * 4
  if redis.call('TYPE', KEYS[i]).ok == 'stream' then redis.call('DEL', KEYS[i]) end
  redis.call('RPUSH', KEYS[i], ARGV[a + 1], ARGV[a + 2], ARGV[a + 3])
  redis.call('LTRIM', KEYS[i], keep, -1)
  redis.call('PEXPIRE', KEYS[i], ret)
  redis.call('ZADD', KEYS[1], 'GT', ARGV[a + 2], ARGV[a])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', '(' .. ARGV[3])
local over = redis.call('ZRANGE', KEYS[1], 0, -(tonumber(ARGV[4]) + 1))
for _, id in ipairs(over) do redis.call('DEL', ARGV[5] .. id) end
redis.call('ZREMRANGEBYRANK', KEYS[1], 0, -(tonumber(ARGV[4]) + 1))
redis.call('PEXPIRE', KEYS[1], ret)
return #KEYS - 1
"""


class RequestJournal:
    """Append-only, self-expiring log of request states. Durations in seconds."""

    def __init__(self, conn: StateConnection, *, retention: float = DEFAULT_RETENTION,
                 recent_cap: int = DEFAULT_RECENT_CAP, max_entries: int = DEFAULT_MAX_ENTRIES) -> None:
        if not (math.isfinite(retention) and retention >= 0.001):
            raise ValueError(f"retention must be at least 0.001 s, got {retention!r}")
        for name, value in (("recent_cap", recent_cap), ("max_entries", max_entries)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self._conn = conn
        self._keys = conn.keys
        self.retention = retention
        self.recent_cap = recent_cap
        self.max_entries = max_entries
        self._retention_ms = math.ceil(retention * 1000)
        self._record = conn.redis.register_script(_RECORD)

    def record(self, request_id: str, state: RequestState | str, at: float, detail: str = "") -> None:
        """Append a transition. ``detail`` beyond ``MAX_DETAIL`` characters is truncated."""
        self.record_many([self.entry(request_id, state, at, detail)])

    def entry(self, request_id: str, state: RequestState | str, at: float,
              detail: str = "") -> tuple[str, JournalEntry]:
        """A checked (request id, entry) pair; ValueError (or InvalidKeyPart) names what is wrong."""
        self._keys.journal(request_id)  # refuses an id that cannot be a key part
        try:
            state = RequestState(state)
        except ValueError:
            names = ", ".join(s.value for s in RequestState)
            raise ValueError(f"unknown request state {state!r}; expected one of: {names}") from None
        if isinstance(at, bool) or not isinstance(at, (int, float)) or not math.isfinite(at):
            raise ValueError(f"at must be a finite time in seconds, got {at!r}")
        return request_id, JournalEntry(state, float(at), detail[:MAX_DETAIL])

    def record_many(self, entries: list[tuple[str, JournalEntry]]) -> None:
        """Append checked entries (from ``entry``) in one round trip: one script call for the whole
        batch (``_RECORD``), atomic as the MULTI/EXEC pipeline it replaced, which cost the writing
        process ~3 commands of client-side packing and parsing per entry."""
        if not entries:
            return
        latest = max(e.at for _, e in entries)
        keys = [self._keys.journals()]
        args: list[object] = [self._retention_ms, self.max_entries, repr(latest - self.retention), self.recent_cap,
                              self._keys.journal_prefix()]
        for request_id, e in entries:
            keys.append(self._keys.journal(request_id))
            args += (request_id, e.state.value, repr(e.at), e.detail)
        with self._conn.guard():
            self._record(keys=keys, args=args)

    def history(self, request_id: str) -> list[JournalEntry]:
        """The request's transitions in the order they were recorded; [] if unknown or expired."""
        with self._conn.guard():
            try:
                raw = self._conn.redis.lrange(self._keys.journal(request_id), 0, -1)
            except redis.ResponseError as exc:  # a stream an older version wrote: unreadable here, expires
                if "WRONGTYPE" not in str(exc):
                    raise
                return []
        return [JournalEntry(RequestState(raw[i]), float(raw[i + 1]), raw[i + 2]) for i in range(0, len(raw) - 2, 3)]

    def recent(self, n: int) -> list[str]:
        """Up to ``n`` request ids, most recently active first."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 0:
            raise ValueError(f"n must be a non-negative integer, got {n!r}")
        if n == 0:
            return []
        with self._conn.guard():
            return list(self._conn.redis.zrevrange(self._keys.journals(), 0, n - 1))

    def forget(self, request_id: str) -> None:
        """Delete a request's journal and its index entry now."""
        with self._conn.guard():
            pipe = self._conn.redis.pipeline(transaction=True)
            pipe.delete(self._keys.journal(request_id))
            pipe.zrem(self._keys.journals(), request_id)
            pipe.execute()


class BackgroundJournal:
    """Journal writes off the request path: ``record`` checks the entry and queues it; a daemon thread
    writes whatever queued in one round trip. The journal is for status and debugging, so when Redis is
    slow or away the oldest queued entries beyond ``max_queued`` are dropped (counted in ``dropped``)
    rather than slowing or failing requests; entries in a write that fails are counted in ``lost``.
    ``flush`` waits until what was queued is written (or lost)."""

    def __init__(self, journal: RequestJournal, max_queued: int = 10_000) -> None:
        self.journal = journal
        self.max_queued = max_queued
        self.dropped = 0
        self.lost = 0
        self._queue: collections.deque[tuple[str, JournalEntry]] = collections.deque()
        self._cond = threading.Condition()
        self._written = 0
        self._queued = 0
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="journal-writer", daemon=True)
        self._thread.start()

    def record(self, request_id: str, state: RequestState | str, at: float, detail: str = "") -> None:
        item = self.journal.entry(request_id, state, at, detail)
        with self._cond:
            if len(self._queue) >= self.max_queued:
                self._queue.popleft()
                self.dropped += 1
                self._written += 1  # counted as settled, so flush() does not wait for it
            self._queue.append(item)
            self._queued += 1
            self._cond.notify()

    def history(self, request_id: str) -> list[JournalEntry]:
        return self.journal.history(request_id)

    def recent(self, n: int) -> list[str]:
        return self.journal.recent(n)

    def flush(self, timeout_s: float = 5.0) -> bool:
        """True once every entry queued before the call was written (or given up on)."""
        with self._cond:
            target = self._queued
            return self._cond.wait_for(lambda: self._written >= target, timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        self.flush(timeout_s)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._queue or self._closed)
                if not self._queue and self._closed:
                    return
                batch = list(self._queue)
                self._queue.clear()
            try:
                self.journal.record_many(batch)
            except Exception as exc:  # Redis away: the entries are lost, requests go on
                self.lost += len(batch)
                log.warning("request journal write of %d entries failed: %s", len(batch), exc)
            with self._cond:
                self._written += len(batch)
                self._cond.notify_all()
