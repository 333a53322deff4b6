"""The request journal's memory bound, against a real redis-server: ``recent_cap`` bounds the records kept
(a request trimmed from the index loses its record too), and a finished record is a small list.

Every test writes under its own prefix and ends with no key left under it (``state_conn`` checks)."""

from __future__ import annotations

import pytest

from controlplane.state import JournalEntry, RequestJournal, RequestState, StateConnection

from redis_fixture import redis_server, state_conn  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.integration]

LIFE = (RequestState.RECEIVED, RequestState.QUEUED, RequestState.PREFILLING, RequestState.DECODING,
        RequestState.FINISHED)


def record_life(journal: RequestJournal, rid: str, at: float) -> None:
    for i, state in enumerate(LIFE):
        journal.record(rid, state, at + i / 100, "prefill prefill-vm-0 -> decode decode-vm-1" if i == 3 else "")


def test_recent_cap_bounds_the_records_kept(state_conn: StateConnection):
    journal = RequestJournal(state_conn, retention=600.0, recent_cap=5)
    for i in range(12):
        record_life(journal, f"r-{i}", 1000.0 + i)
    kept = [f"r-{i}" for i in range(11, 6, -1)]
    assert journal.recent(100) == kept
    held = sorted(k for k in state_conn.redis.scan_iter(match=state_conn.keys.journal_prefix() + "*"))
    assert held == sorted(state_conn.keys.journal(r) for r in kept)  # the trimmed requests' records are gone
    assert journal.history("r-0") == []
    assert [e.state for e in journal.history("r-11")] == list(LIFE)
    assert journal.history("r-11")[3] == JournalEntry(RequestState.DECODING, 1011.03,
                                                      "prefill prefill-vm-0 -> decode decode-vm-1")
    for r in kept:
        journal.forget(r)


def test_max_entries_keeps_the_newest_and_a_finished_record_is_small(state_conn: StateConnection):
    journal = RequestJournal(state_conn, retention=600.0, max_entries=4)
    record_life(journal, "long", 50.0)
    assert [e.state for e in journal.history("long")] == list(LIFE[1:])
    record_life(journal, "done", 60.0)
    # a stream took about 4.6 KB for such a record (Redis preallocates its listpack); the list a few hundred bytes
    assert state_conn.redis.memory_usage(state_conn.keys.journal("done")) < 1024
    journal.forget("long")
    journal.forget("done")


def test_a_record_left_as_a_stream_is_replaced(state_conn: StateConnection):
    key = state_conn.keys.journal("old")
    state_conn.redis.xadd(key, {"state": "received", "at": "1.0", "detail": ""})
    journal = RequestJournal(state_conn, retention=600.0)
    assert journal.history("old") == []  # an older version's record reads as none, not as an error
    journal.record("old", RequestState.FINISHED, 2.0)
    assert journal.history("old") == [JournalEntry(RequestState.FINISHED, 2.0)]
    journal.forget("old")
