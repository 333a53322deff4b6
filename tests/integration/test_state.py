"""Control-plane state against a real redis-server: leases, targets, journal, counters, key layout, outages.

Every test writes under its own prefix and ends with no key left under it (``state_conn`` checks).
"""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
import redis

from controlplane.state import (
    Counters,
    InvalidKeyPart,
    JournalEntry,
    KeySpace,
    LocalRedis,
    ManualClock,
    Pool,
    PoolTargets,
    RedisServerNotFound,
    RequestJournal,
    RequestState,
    StateConnection,
    StateError,
    StateRefused,
    StateUnavailable,
    SystemClock,
    WorkerInfo,
    WorkerLoad,
    WorkerNotRegistered,
    WorkerRegistry,
    connect,
)
from controlplane.state.journal import BackgroundJournal
from controlplane.state.keys import KEY_LAYOUT

from redis_fixture import keys_under, process_gone, redis_server, state_conn  # noqa: F401  (fixtures)

pytestmark = [pytest.mark.integration]


def info(worker_id: str, pool: Pool = Pool.DECODE, port: int = 50051, **kwargs) -> WorkerInfo:
    return WorkerInfo(worker_id=worker_id, pool=pool, address=f"127.0.0.1:{port}", model_fingerprint="sha256:ab",
                      version="0.1.0", **kwargs)


def live_ids(registry: WorkerRegistry, pool: Pool | str) -> list[str]:
    return [r.info.worker_id for r in registry.live_workers(pool)]


# --- the local server ---------------------------------------------------------------------------------

def test_local_server_is_private_and_unpersisted(redis_server: LocalRedis, state_conn: StateConnection):
    config = state_conn.redis.config_get("*")
    assert config["save"] == "" and config["appendonly"] == "no"
    assert config["bind"] == "127.0.0.1" and int(config["port"]) == redis_server.port


def test_a_password_keeps_other_clients_out_and_stays_off_the_command_line():
    with LocalRedis(password="pw-0123456789abcdef") as server:
        assert server.url == f"redis://default:pw-0123456789abcdef@127.0.0.1:{server.port}"
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port, socket_timeout=2).ping()
        with pytest.raises(redis.exceptions.AuthenticationError):
            redis.Redis(port=server.port, password="wrong", socket_timeout=2).ping()
        assert redis.Redis.from_url(server.url, socket_timeout=2).ping()
        cli = subprocess.run(["redis-cli", "-u", server.url, "ping"], capture_output=True, text=True, timeout=10)
        assert cli.stdout.strip() == "PONG", (cli.stdout, cli.stderr)  # docs/configuration.md: for redis-cli -u
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes()
        assert b"pw-0123456789abcdef" not in cmdline and b"requirepass" not in cmdline
    for bad in ("", "has space", "a@b", "a:b", "a%41b"):  # %: the URL would decode it to another password
        with pytest.raises(ValueError, match="password must be"):
            LocalRedis(password=bad)


def test_missing_redis_server_says_how_to_install():
    with pytest.raises(RedisServerNotFound, match=r"apt-get install -y redis-server"):
        LocalRedis(executable="redis-server-not-installed-anywhere")


def test_close_kills_a_server_that_ignores_sigterm():
    server = LocalRedis(stop_grace=0.2).start()
    pid = server.pid
    os.kill(pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    started = time.monotonic()
    server.close()
    assert process_gone(pid) and time.monotonic() - started < 2
    server.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        server.start()


# --- worker registry ------------------------------------------------------------------------------------

def test_register_heartbeat_and_live_workers(state_conn: StateConnection):
    clock = ManualClock(1000.0)
    registry = WorkerRegistry(state_conn, clock=clock, ttl=5.0)
    d1, d0, p0 = info("d1", port=1), info("d0", port=2), info("p0", Pool.PREFILL, port=3)
    for worker in (d1, d0, p0):
        assert registry.register(worker) == 1005.0
    records = registry.live_workers(Pool.DECODE)
    assert [r.info for r in records] == [d0, d1]  # sorted by id, fields round-trip exactly
    assert records[0].heartbeat_at == 1000.0 and records[0].lease_expires_at == 1005.0
    assert live_ids(registry, "prefill") == ["p0"] and registry.live_workers(Pool.ENCODE) == []

    clock.advance(4.0)
    load = WorkerLoad(queued_tokens=120, free_kv_blocks=30, total_kv_blocks=64, running=2)
    assert registry.heartbeat("d1", "decode", load) == 1009.0
    clock.advance(2.0)  # t=1006: d0's lease (1005) is over, d1's (1009) is not
    [record] = registry.live_workers(Pool.DECODE)
    assert record.info == dataclasses.replace(d1, load=load) and record.lease_expires_at == 1009.0
    assert registry.get("d0", Pool.DECODE) is None and registry.find("d1") == record
    assert state_conn.redis.zscore(state_conn.keys.workers(Pool.DECODE), "d0") is None  # pruned from the index
    # Its hash lingers until Redis's hard expiry (two TTLs of real time); remove the rest explicitly.
    assert keys_under(state_conn) == sorted([state_conn.keys.worker("decode", w) for w in ("d0", "d1")]
                                            + [state_conn.keys.worker("prefill", "p0"),
                                               state_conn.keys.workers("decode"), state_conn.keys.workers("prefill")])
    with pytest.raises(WorkerNotRegistered, match="register it again"):
        registry.heartbeat("ghost", Pool.DECODE, load)
    for worker_id, pool in (("d0", "decode"), ("d1", "decode"), ("p0", "prefill")):
        assert registry.deregister(worker_id, pool)


def test_a_redis_that_refuses_writes_still_lists_workers_and_says_why(state_conn: StateConnection):
    """At maxmemory with noeviction, Redis refuses writes but answers reads: routing and /admin read the live
    workers (the index's pruning, a write, waits for room), and a write fails as StateRefused, a kind of
    StateUnavailable, whose message names the cause, where it was a raw redis-py error (a 500 on /admin)."""
    clock = ManualClock(1000.0)
    registry = WorkerRegistry(state_conn, clock=clock, ttl=5.0)
    registry.register(info("gone", port=9))
    clock.advance(3.0)
    registry.register(info("d0", port=1))
    registry.register(info("d1", port=2))
    clock.advance(3.0)  # "gone" is past its lease and due to be pruned from the index
    r = state_conn.redis
    saved = {k: r.config_get(k)[k] for k in ("maxmemory", "maxmemory-policy")}
    r.config_set("maxmemory-policy", "noeviction")
    r.config_set("maxmemory", 1)
    try:
        assert live_ids(registry, "decode") == ["d0", "d1"]
        refusal = (r"^Redis at \S+ refuses writes: command not allowed when used memory > 'maxmemory'.* \(raise its "
                   r"maxmemory, or free memory there\)$")
        with pytest.raises(StateRefused, match=refusal) as refused:
            registry.heartbeat("d0", "decode", WorkerLoad(queued_tokens=1))
        assert isinstance(refused.value, StateUnavailable)
    finally:
        for key, value in saved.items():
            r.config_set(key, value)
    assert live_ids(registry, "decode") == ["d0", "d1"]
    assert r.zscore(state_conn.keys.workers(Pool.DECODE), "gone") is None  # pruned once Redis had room
    for worker_id in ("gone", "d0", "d1"):
        registry.deregister(worker_id, "decode")


def test_silent_worker_leaves_routing_within_two_ttls(state_conn: StateConnection):
    ttl = 0.3
    registry = WorkerRegistry(state_conn, clock=SystemClock(), ttl=ttl)
    registry.register(info("steady"))
    registry.register(info("silent"))
    stop = time.time() + 0.45  # beat both for longer than one TTL: heartbeats keep a lease alive
    while time.time() < stop:
        registry.heartbeat("steady", Pool.DECODE, WorkerLoad())
        registry.heartbeat("silent", Pool.DECODE, WorkerLoad())
        assert live_ids(registry, Pool.DECODE) == ["silent", "steady"]
        time.sleep(0.05)
    last_beat = time.time()
    registry.heartbeat("silent", Pool.DECODE, WorkerLoad())
    hash_key = state_conn.keys.worker(Pool.DECODE, "silent")
    left_routing = gone_from_redis = None
    while time.time() - last_beat < 3 * ttl and gone_from_redis is None:
        registry.heartbeat("steady", Pool.DECODE, WorkerLoad())
        if left_routing is None and live_ids(registry, Pool.DECODE) == ["steady"]:
            left_routing = time.time() - last_beat
        if not state_conn.redis.exists(hash_key):
            gone_from_redis = time.time() - last_beat
        time.sleep(0.02)
    assert left_routing is not None and left_routing <= 2 * ttl
    assert gone_from_redis is not None and gone_from_redis <= 2 * ttl + 0.05
    with pytest.raises(WorkerNotRegistered):
        registry.heartbeat("silent", Pool.DECODE, WorkerLoad())
    assert keys_under(state_conn) == sorted([state_conn.keys.worker(Pool.DECODE, "steady"),
                                             state_conn.keys.workers(Pool.DECODE)])
    assert registry.deregister("steady", Pool.DECODE)


def test_draining_flag_survives_heartbeats(state_conn: StateConnection):
    registry = WorkerRegistry(state_conn, clock=ManualClock(), ttl=5.0)
    registry.register(info("d0"))
    registry.set_draining("d0", Pool.DECODE)
    registry.heartbeat("d0", Pool.DECODE, WorkerLoad(running=1))
    [record] = registry.live_workers(Pool.DECODE)
    assert record.info.draining and record.info.load.running == 1
    registry.set_draining("d0", "decode", draining=False)
    assert not registry.live_workers(Pool.DECODE)[0].info.draining
    registry.register(info("d0", draining=True))  # a fresh registration states its own flag
    assert registry.get("d0", Pool.DECODE).info.draining
    with pytest.raises(WorkerNotRegistered, match="not registered"):
        registry.set_draining("nobody", Pool.DECODE)
    registry.deregister("d0", Pool.DECODE)


def test_deregister_is_immediate_and_idempotent(state_conn: StateConnection):
    registry = WorkerRegistry(state_conn, clock=ManualClock(), ttl=5.0)
    registry.register(info("e0", Pool.ENCODE))
    assert registry.deregister("e0", Pool.ENCODE) is True
    assert registry.live_workers(Pool.ENCODE) == [] and registry.find("e0") is None
    assert registry.deregister("e0", Pool.ENCODE) is False
    with pytest.raises(WorkerNotRegistered):
        registry.heartbeat("e0", Pool.ENCODE, WorkerLoad())


@pytest.mark.parametrize("bad_id", ["", "a:b", "a b", "tab\t", "x" * 257])
def test_invalid_ids_are_refused(state_conn: StateConnection, bad_id: str):
    with pytest.raises(InvalidKeyPart, match="worker id"):
        info(bad_id)
    with pytest.raises(InvalidKeyPart, match="request id"):
        RequestJournal(state_conn).record(bad_id, RequestState.RECEIVED, 1.0)
    with pytest.raises(InvalidKeyPart, match="counter name"):
        Counters(state_conn).incr(bad_id)


def test_worker_info_validation(state_conn: StateConnection):
    with pytest.raises(InvalidKeyPart, match="unknown pool 'gpu'; expected one of: encode, prefill, decode"):
        info("w", pool="gpu")  # type: ignore[arg-type]  # an unknown pool, refused
    assert info("w", pool="prefill").pool is Pool.PREFILL  # type: ignore[arg-type]  # a pool's name is parsed
    for address in ("localhost", ":80", "host:0", "host:70000", "host:http"):
        with pytest.raises(ValueError, match="host:port"):
            WorkerInfo("w", Pool.DECODE, address)
    with pytest.raises(ValueError, match="queued_tokens must be a non-negative integer"):
        WorkerLoad(queued_tokens=-1)
    with pytest.raises(ValueError, match="exceeds total_kv_blocks"):
        WorkerLoad(free_kv_blocks=5, total_kv_blocks=4)
    with pytest.raises(ValueError, match="ttl"):
        WorkerRegistry(state_conn, ttl=0)
    for prefix in ("a:b", "a b", "a*", ""):
        with pytest.raises(InvalidKeyPart, match="key prefix"):
            KeySpace(prefix)


# --- pool targets -------------------------------------------------------------------------------------------

def test_pool_targets_and_validation(state_conn: StateConnection):
    targets = PoolTargets(state_conn)
    assert targets.get_target(Pool.DECODE) is None and targets.all_targets() == {}
    targets.set_target(Pool.DECODE, 2)
    targets.set_target("encode", 0)
    targets.set_target(Pool.PREFILL, 1000)
    assert targets.get_target("decode") == 2
    assert list(targets.all_targets().items()) == [(Pool.ENCODE, 0), (Pool.PREFILL, 1000), (Pool.DECODE, 2)]
    for bad in (-1, 1001, True, 2.0, "3"):
        with pytest.raises(ValueError, match="replicas must be"):
            targets.set_target(Pool.DECODE, bad)  # type: ignore[arg-type]  # refused values
    with pytest.raises(InvalidKeyPart, match="unknown pool"):
        targets.set_target("gpu", 1)
    assert targets.get_target(Pool.DECODE) == 2  # a refused write changes nothing
    assert keys_under(state_conn) == sorted(state_conn.keys.pool_target(p) for p in Pool)
    assert [targets.clear_target(p) for p in Pool] == [True, True, True]
    assert targets.clear_target(Pool.DECODE) is False


def test_a_scale_survives_a_restart_with_the_same_settings_and_new_settings_win(state_conn: StateConnection):
    targets = PoolTargets(state_conn)
    assert targets.apply_configured(Pool.DECODE, 2) == 2  # first start: the settings
    targets.set_target(Pool.DECODE, 5)  # epd scale decode 5
    assert targets.apply_configured(Pool.DECODE, 2) == 5  # restart, same settings: the scale is kept
    assert targets.get_target(Pool.DECODE) == 5
    assert targets.apply_configured(Pool.DECODE, 3) == 3  # restart with new settings (helm upgrade): they win
    targets.set_target(Pool.DECODE, 1)
    assert targets.apply_configured(Pool.DECODE, 3) == 1
    with pytest.raises(ValueError, match="between 0 and 1000"):
        targets.apply_configured(Pool.DECODE, -1)
    assert targets.get_target(Pool.DECODE) == 1  # a refused call changes nothing
    assert targets.clear_target(Pool.DECODE) is True
    assert keys_under(state_conn) == []  # the configured value went with the target
    assert targets.apply_configured(Pool.DECODE, 3) == 3  # a cleared pool starts from the settings again
    targets.clear_target(Pool.DECODE)


# --- request journal ------------------------------------------------------------------------------------

def test_journal_keeps_order_details_and_retention(state_conn: StateConnection):
    journal = RequestJournal(state_conn, retention=60.0)
    path = [RequestState.RECEIVED, RequestState.QUEUED, RequestState.PREFILLING, RequestState.TRANSFERRING,
            RequestState.DECODING, RequestState.FINISHED]
    for i, state in enumerate(path):
        journal.record("req-1", state, 500.0 + i / 10, detail=f"step {i}")
    journal.record("req-2", "received", 500.05)
    journal.record("req-2", RequestState.FAILED, 500.06, detail="x" * 5000)
    assert journal.history("req-1") == [JournalEntry(s, 500.0 + i / 10, f"step {i}") for i, s in enumerate(path)]
    failed = journal.history("req-2")[-1]
    assert failed.state is RequestState.FAILED and len(failed.detail) == 1024
    assert journal.history("never-seen") == []
    assert journal.recent(10) == ["req-1", "req-2"]  # req-1's last transition (500.5) is the newest
    assert journal.recent(1) == ["req-1"] and journal.recent(0) == []
    for key in (state_conn.keys.journal("req-1"), state_conn.keys.journals()):
        assert 59_000 < state_conn.redis.pttl(key) <= 60_000
    with pytest.raises(ValueError, match="unknown request state 'done'"):
        journal.record("req-1", "done", 1.0)
    with pytest.raises(ValueError, match="finite"):
        journal.record("req-1", RequestState.ABORTED, float("nan"))
    journal.forget("req-1")
    journal.forget("req-2")
    assert journal.recent(10) == []


def test_background_journal_writes_off_the_request_path_in_order(state_conn: StateConnection):
    journal = BackgroundJournal(RequestJournal(state_conn, retention=60.0))
    try:
        for i in range(200):
            journal.record(f"bg-{i % 4}", RequestState.RECEIVED if i < 4 else RequestState.DECODING, 100.0 + i)
        with pytest.raises(ValueError, match="unknown request state"):
            journal.record("bg-0", "done", 1.0)  # refused at once, nothing queued
        assert journal.flush(10)
        assert [len(journal.history(f"bg-{k}")) for k in range(4)] == [50, 50, 50, 50]
        assert [e.at for e in journal.history("bg-1")] == [101.0 + 4 * i for i in range(50)]
        assert journal.dropped == 0 and journal.lost == 0
    finally:
        journal.close()
        for k in range(4):
            journal.journal.forget(f"bg-{k}")


def test_background_journal_drops_the_oldest_beyond_its_bound_and_survives_redis_errors(state_conn):
    class Broken(RequestJournal):
        def record_many(self, entries):
            raise StateError("redis is away")

    journal = BackgroundJournal(Broken(state_conn), max_queued=3)
    try:
        for i in range(50):
            journal.record("lost", RequestState.RECEIVED, 1.0 + i)
        assert journal.flush(10)
        assert journal.lost >= 1 and journal.dropped + journal.lost == 50
    finally:
        journal.close()


def test_journal_entries_expire_after_retention(state_conn: StateConnection):
    journal = RequestJournal(state_conn, retention=0.2)
    journal.record("short-lived", RequestState.RECEIVED, time.time())
    assert len(journal.history("short-lived")) == 1
    time.sleep(0.3)
    assert journal.history("short-lived") == [] and journal.recent(5) == []


def test_recent_index_is_capped_and_trimmed_by_age(state_conn: StateConnection):
    journal = RequestJournal(state_conn, retention=100.0, recent_cap=5, max_entries=3)
    ids = [f"r{i:02d}" for i in range(12)]
    for i, request_id in enumerate(ids):
        journal.record(request_id, RequestState.RECEIVED, 1000.0 + i)
    assert state_conn.redis.zcard(state_conn.keys.journals()) == 5
    assert journal.recent(100) == ids[:-6:-1]
    for i in range(5):  # each stream is capped too
        journal.record("r11", RequestState.DECODING, 1012.0 + i)
    assert [e.at for e in journal.history("r11")] == [1014.0, 1015.0, 1016.0]
    journal.record("late", RequestState.RECEIVED, 1200.0)  # everything older than 100 s leaves the index
    assert journal.recent(100) == ["late"]
    for request_id in [*ids, "late"]:
        journal.forget(request_id)


# --- counters ------------------------------------------------------------------------------------------------

def test_counters_are_atomic(state_conn: StateConnection):
    counters = Counters(state_conn)
    assert counters.get("requests_total") == 0 and counters.get_all() == {}
    assert counters.incr("requests_total") == 1
    assert counters.incr("requests_total", 4) == 5
    assert counters.incr("in_flight", 3) == 3 and counters.incr("in_flight", -1) == 2
    with pytest.raises(ValueError, match="integer"):
        counters.incr("in_flight", 1.5)  # type: ignore[arg-type]  # refused

    def bump() -> None:
        for _ in range(200):
            counters.incr("tokens_total", 2)

    threads = [threading.Thread(target=bump) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert counters.get_all() == {"in_flight": 2, "requests_total": 5, "tokens_total": 1600}
    counters.reset("in_flight")
    assert counters.get_all() == {"requests_total": 5, "tokens_total": 1600}
    counters.reset_all()
    assert counters.get_all() == {}


# --- key layout -----------------------------------------------------------------------------------------------

def test_every_key_is_under_the_prefix_and_documented(redis_server: LocalRedis):
    conn = connect(f"{redis_server.url}/9", "layout")  # a database of its own, so a full SCAN sees only us
    try:
        registry = WorkerRegistry(conn, clock=ManualClock(), ttl=5.0)
        for pool in Pool:
            registry.register(info(f"{pool.value}-0", pool))
        PoolTargets(conn).apply_configured(Pool.DECODE, 3)
        RequestJournal(conn).record("req", RequestState.RECEIVED, 1.0)
        Counters(conn).incr("requests_total")
        seen = set()
        for key in conn.redis.scan_iter(match="*"):
            spec = conn.keys.spec_of(key)
            assert conn.keys.owns(key) and spec is not None, f"undocumented key {key}"
            assert conn.redis.type(key) == spec.redis_type, key
            seen.add(spec)
        assert seen == set(KEY_LAYOUT)
        for pool in Pool:
            registry.deregister(f"{pool.value}-0", pool)
        PoolTargets(conn).clear_target(Pool.DECODE)
        RequestJournal(conn).forget("req")
        Counters(conn).reset_all()
        assert list(conn.redis.scan_iter(match="*")) == []
    finally:
        conn.close()


# --- Redis going away ----------------------------------------------------------------------------------------

def test_redis_outage_raises_state_unavailable_then_reconnects():
    first = LocalRedis().start()
    port, pid = first.port, first.pid
    conn = connect(first.url, "outage", retries=2, backoff_base=0.02, backoff_cap=0.1)
    registry = WorkerRegistry(conn, clock=ManualClock(), ttl=5.0)
    targets, journal, counters = PoolTargets(conn), RequestJournal(conn), Counters(conn)
    second = None
    try:
        registry.register(info("d0"))
        targets.set_target(Pool.DECODE, 1)
        first.close()
        assert process_gone(pid)
        calls = [conn.ping, lambda: registry.live_workers(Pool.DECODE), lambda: targets.set_target(Pool.DECODE, 2),
                 lambda: journal.record("r", RequestState.RECEIVED, 1.0), lambda: counters.incr("n"),
                 lambda: registry.heartbeat("d0", Pool.DECODE, WorkerLoad())]
        for call in calls:
            started = time.monotonic()
            with pytest.raises(StateUnavailable, match=rf"^cannot reach Redis at redis://127\.0\.0\.1:{port}: ") as err:
                call()
            assert time.monotonic() - started < 2.0
            assert not isinstance(err.value, redis.RedisError)
            assert isinstance(err.value.__cause__, redis.ConnectionError)

        second = LocalRedis(port=port).start()  # same address, empty (no persistence)
        conn.ping()
        with pytest.raises(WorkerNotRegistered):  # the lease did not survive: the worker registers again
            registry.heartbeat("d0", Pool.DECODE, WorkerLoad())
        registry.register(info("d0"))
        assert live_ids(registry, Pool.DECODE) == ["d0"]
        assert targets.get_target(Pool.DECODE) is None
        registry.deregister("d0", Pool.DECODE)
        assert keys_under(conn) == []
    finally:
        conn.close()
        first.close()
        if second is not None:
            second.close()
            assert process_gone(second.pid)


def test_connect_fails_fast_with_a_clear_redacted_message():
    with LocalRedis() as server:
        port = server.port
    started = time.monotonic()
    with pytest.raises(StateUnavailable) as err:
        connect(f"redis://user:s3cret@127.0.0.1:{port}/0", retries=1, backoff_base=0.01)
    assert time.monotonic() - started < 2.0
    message = str(err.value)
    assert message.startswith(f"cannot reach Redis at redis://user:***@127.0.0.1:{port}/0: ")
    assert "s3cret" not in message
