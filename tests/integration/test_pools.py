"""The three pools as Ray actors on a private local Ray, kept at their Redis targets by ``PoolManager``.

One manager (and one Ray) serves the whole module, and the tests run in order: the pools come up and
serve the oracle's tokens; decode scales up without touching the other pools, then down by draining the
replica that serves a live stream; a target written straight to Redis is picked up; a lost lease comes
back on its own while a dead process is replaced; one pool's drain holds up no other pool; an idle replica
scaled down stays up until routing has seen it drain; a replica that cannot start says why; and ``stop()``
leaves no process, temp dir or lease behind.
"""

from __future__ import annotations

import io
import os
import secrets
import signal
import stat
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import ray
import torch
from PIL import Image

from controlplane.dispatch import Dispatcher, Route, WorkerRequest
from controlplane.pools import PoolManager, PoolStatus, WorkerStartError
from controlplane.serve import rewrite_targets
from controlplane.settings import MiB, Settings
from controlplane.state import LocalRedis, Pool, PoolTargets, WorkerRegistry, connect
from kvtransfer.auth import TransferSecurity
from workers.runtime.generate import GenerateRequest, build_prompt, generate
from workers.runtime.sampler import SamplingParams

from redis_fixture import keys_under, process_gone, redis_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]

TOKEN = secrets.token_urlsafe(24)
SECURITY = TransferSecurity(token=TOKEN)
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def pool_settings(model: Path | None, **replicas: int) -> Settings:
    pools: dict[str, Any] = {p.value: {"replicas": replicas.get(p.value, 1), "num_cpus": 0.25,
                                       "engine": {"kv_cache_bytes": 32 * MiB}} for p in Pool}
    return Settings(model=model, transfer={"codec_policy": "fp32", "token": TOKEN}, **pools)


@pytest.fixture(scope="module")
def manager(redis_server: LocalRedis, default_ckpt: Path):
    m = PoolManager(pool_settings(default_ckpt), redis_server.url, f"pools-{uuid.uuid4().hex[:8]}", TOKEN)
    m.start()
    yield m
    m.stop()  # idempotent: the last test stops it already


@pytest.fixture(scope="module")
def dispatcher():
    d = Dispatcher(SECURITY)
    yield d
    d.close()


def by_pool(m: PoolManager) -> dict[Pool, PoolStatus]:
    return {s.pool: s for s in m.status()}


def live_ids(m: PoolManager, pool: Pool) -> list[str]:
    return [r.worker_id for r in by_pool(m)[pool].replicas]


def pids(m: PoolManager, pool: Pool) -> dict[str, int]:
    return {r.worker_id: ray.get(r.actor.pid.remote(), timeout=30) for r in m.replicas(pool)}


def route_from_registry(m: PoolManager) -> Route:
    status = by_pool(m)
    first = {pool: next(r.address for r in s.replicas if not r.draining) for pool, s in status.items()}
    return Route(decode=first[Pool.DECODE], prefill=first[Pool.PREFILL], encode=first[Pool.ENCODE])


def run(d: Dispatcher, route: Route, req: WorkerRequest) -> list[int]:
    return [t for chunk in d.run(req, route) for t in chunk.token_ids]


def wait_for(cond: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"timed out after {timeout_s} s waiting for {what}"
        time.sleep(0.2)


def png(color: tuple[int, int, int]) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (48, 36), color).save(buf, "PNG")
    return buf.getvalue()


def gone(pid: int) -> bool:
    """Exited: no such process, or a zombie nobody has reaped yet (it runs nothing)."""
    if process_gone(pid):
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_all_pools_come_up_live_in_the_registry(manager: PoolManager):
    status = by_pool(manager)
    assert [s.pool for s in manager.status()] == [Pool.ENCODE, Pool.PREFILL, Pool.DECODE]
    for pool, s in status.items():
        assert s.target == 1 and s.managed == 1 and s.ready == 1, s
        (replica,) = s.replicas
        (mine,) = manager.replicas(pool)
        assert (replica.worker_id, replica.address, replica.managed) == (mine.worker_id, mine.address, True)
        assert replica.address.startswith("127.0.0.1:") and not replica.draining
    decode = status[Pool.DECODE].replicas[0].load
    assert decode.total_kv_blocks > 0 and decode.free_kv_blocks == decode.total_kv_blocks
    for pool in status:  # each replica's process started with the pool's malloc arenas (default 2)
        (pid,) = pids(manager, pool).values()
        assert b"MALLOC_ARENA_MAX=2\0" in Path(f"/proc/{pid}/environ").read_bytes()


def test_requests_through_the_registry_match_the_reference(manager: PoolManager, dispatcher: Dispatcher,
                                                           default_bundle):
    route = route_from_registry(manager)
    text = GenerateRequest(messages=[{"role": "user", "content": "What is the capital of France?"}], params=GREEDY)
    ids, _ = build_prompt(default_bundle, text)
    expected = generate(default_bundle, [text])[0].token_ids
    assert run(dispatcher, route, WorkerRequest("pools-text", ids, GREEDY)) == expected

    images = (png((200, 30, 30)),)
    image = GenerateRequest(messages=[{"role": "user", "content": [{"type": "image"},
                                                                   {"type": "text", "text": "Describe it."}]}],
                            images=images, params=GREEDY)
    ids, mm = build_prompt(default_bundle, image)
    tokens = run(dispatcher, route, WorkerRequest("pools-image", ids, GREEDY, images, mm.positions))
    assert tokens == generate(default_bundle, [image])[0].token_ids


def test_scaling_decode_up_leaves_the_other_pools_alone(manager: PoolManager):
    before = {pool: pids(manager, pool) for pool in (Pool.ENCODE, Pool.PREFILL)}
    (old_decode,) = live_ids(manager, Pool.DECODE)
    manager.scale("decode", 2)
    decode = live_ids(manager, Pool.DECODE)
    assert len(decode) == 2 and old_decode in decode
    assert by_pool(manager)[Pool.DECODE].target == 2
    for pool, workers in before.items():
        assert pids(manager, pool) == workers  # same worker ids, same processes
        assert live_ids(manager, pool) == sorted(workers)


def test_scaling_decode_down_drains_the_newest_replica_first(manager: PoolManager, dispatcher: Dispatcher,
                                                             default_bundle):
    old, victim = manager.replicas("decode")  # oldest first: the one added last goes
    others = {pool: live_ids(manager, pool) for pool in (Pool.ENCODE, Pool.PREFILL)}
    params = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
    prompt = default_bundle.tokenizer.encode("The cache moves between workers layer by layer.")
    expected = generate(default_bundle, [GenerateRequest(prompt_ids=prompt, params=params)])[0].token_ids
    route = Route(decode=victim.address, prefill=route_from_registry(manager).prefill)

    got: list[int] = []
    errors: list[BaseException] = []
    streaming, finished = threading.Event(), threading.Event()
    finished_at: list[float] = []

    def stream() -> None:
        try:
            for chunk in dispatcher.run(WorkerRequest("pools-long", prompt, params), route):
                got.extend(chunk.token_ids)
                streaming.set()
            finished_at.append(time.monotonic())
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)
        finally:
            streaming.set()
            finished.set()

    conn = connect(manager.redis_url, manager.prefix)
    registry = WorkerRegistry(conn)
    seen_draining: list[bool] = []

    def watch_registry() -> None:  # what a scheduler would see while the stream is still running
        while not finished.is_set():
            record = registry.get(victim.worker_id, "decode")
            if record is not None and record.info.draining:
                seen_draining.append(True)
                return
            time.sleep(0.01)

    consumer = threading.Thread(target=stream)
    consumer.start()
    assert streaming.wait(60)
    in_flight = len(got)
    watcher = threading.Thread(target=watch_registry)
    watcher.start()
    manager.scale("decode", 1)
    scaled_at = time.monotonic()
    consumer.join(60)
    watcher.join(10)
    assert not errors, errors
    assert 0 < in_flight < len(expected), "the stream should still run when the scale-down starts"
    assert got == expected and finished_at[0] <= scaled_at
    assert seen_draining, "routing should see the replica as draining while its stream runs"
    assert live_ids(manager, Pool.DECODE) == [old.worker_id]
    assert [r.worker_id for r in manager.replicas("decode")] == [old.worker_id]
    assert {pool: live_ids(manager, pool) for pool in others} == others
    conn.close()


def test_a_target_written_to_redis_is_picked_up_by_the_loop(manager: PoolManager):
    conn = connect(manager.redis_url, manager.prefix)
    targets = PoolTargets(conn)  # what `epd scale` in another process does: write the target, nothing more
    before = {pool: live_ids(manager, pool) for pool in Pool}
    try:
        targets.set_target("prefill", 2)
        wait_for(lambda: len(live_ids(manager, Pool.PREFILL)) == 2, 120, "a second prefill replica")
        targets.set_target("prefill", 1)
        wait_for(lambda: live_ids(manager, Pool.PREFILL) == before[Pool.PREFILL], 60, "the new replica to go")
    finally:
        targets.set_target("prefill", 1)
        conn.close()
    assert {pool: live_ids(manager, pool) for pool in Pool} == before


def test_scaling_down_stops_a_drained_replica_before_a_routable_one(manager: PoolManager):
    """`epd drain` on the older replica, then a scale-down: the drained one goes, though it is older
    (it used to keep it and stop the only routable replica)."""
    (older,) = manager.replicas("prefill")
    manager.scale("prefill", 2)
    wait_for(lambda: len(live_ids(manager, Pool.PREFILL)) == 2, 120, "a second prefill replica")
    (newer,) = [r for r in manager.replicas("prefill") if r.worker_id != older.worker_id]
    conn = connect(manager.redis_url, manager.prefix)
    try:
        WorkerRegistry(conn).set_draining(older.worker_id, "prefill")
        manager.scale("prefill", 1)
        wait_for(lambda: live_ids(manager, Pool.PREFILL) == [newer.worker_id], 60, "the drained replica to go")
        assert manager.replicas("prefill") == (newer,)
        record = WorkerRegistry(conn).get(newer.worker_id, "prefill")
        assert record is not None and not record.info.draining
    finally:
        conn.close()


def test_a_lost_lease_is_registered_again_not_replaced(manager: PoolManager):
    (replica,) = manager.replicas("prefill")
    pid = ray.get(replica.actor.pid.remote(), timeout=30)
    conn = connect(manager.redis_url, manager.prefix)
    try:  # what a Redis restart does to a lease
        assert WorkerRegistry(conn).deregister(replica.worker_id, "prefill")
    finally:
        conn.close()
    wait_for(lambda: live_ids(manager, Pool.PREFILL) == [replica.worker_id], 30, "the lease to come back")
    time.sleep(manager.reconcile_interval_s * 2)  # the loop has looked at the pool meanwhile
    assert manager.replicas("prefill") == (replica,) and ray.get(replica.actor.pid.remote(), timeout=30) == pid


def test_a_replica_whose_process_dies_is_replaced(manager: PoolManager, dispatcher: Dispatcher):
    (dead,) = manager.replicas("decode")
    os.kill(ray.get(dead.actor.pid.remote(), timeout=30), signal.SIGKILL)  # the actor process we started
    wait_for(lambda: [r.worker_id for r in manager.replicas("decode")] not in ([], [dead.worker_id]), 120,
             "a replacement decode replica")
    (fresh,) = manager.replicas("decode")
    assert live_ids(manager, Pool.DECODE) == [fresh.worker_id]
    ids = [5, 6, 7, 8, 9]
    assert len(run(dispatcher, route_from_registry(manager), WorkerRequest("pools-after", ids, GREEDY))) == 16


def test_a_drain_in_one_pool_holds_up_no_other_pool(manager: PoolManager):
    """A decode scale-down waits for its replica to drain: here a reservation whose KV never comes, held for
    up to 300 s. Meanwhile a prefill target written to Redis is reached, and the decode replica is still
    draining when it is. (One loop reconciled the pools one after another: the prefill replica waited for the
    decode drain, up to the request timeout, as would the replacement of a dead replica.)"""
    from epd.worker.v1 import worker_pb2 as wpb
    from epd.worker.v1 import worker_pb2_grpc as wgrpc

    conn = connect(manager.redis_url, manager.prefix)
    targets = PoolTargets(conn)
    prefill_before = live_ids(manager, Pool.PREFILL)
    try:
        targets.set_target("decode", 2)
        wait_for(lambda: len(manager.replicas("decode")) == 2, 120, "a second decode replica")  # not just its lease
        victim = manager.replicas("decode")[-1]  # the newest: the one a scale-down drains
        with SECURITY.open_channel(victim.address) as channel:
            stub = wgrpc.DecodeWorkerStub(channel)
            params = wpb.SamplingParams(max_tokens=4, temperature=0.0, top_p=1.0)
            stub.Reserve(wpb.ReserveRequest(request_id="held", prompt_token_ids=[5, 6, 7], params=params,
                                            timeout_s=300),
                         metadata=SECURITY.call_metadata(), timeout=30)
            try:
                targets.set_target("decode", 1)
                wait_for(lambda: manager.stopping(victim.worker_id), 30, "the decode replica to drain")
                targets.set_target("prefill", 2)
                wait_for(lambda: len(live_ids(manager, Pool.PREFILL)) == 2, 120, "a second prefill replica")
                assert manager.stopping(victim.worker_id), "the decode drain should still wait on its reservation"
            finally:  # the drain ends now, pass or fail, not 300 s into the tests after this one
                stub.Abort(wpb.AbortRequest(request_id="held"), metadata=SECURITY.call_metadata(), timeout=10)
        wait_for(lambda: victim.worker_id not in live_ids(manager, Pool.DECODE), 60, "the drained replica to go")
        targets.set_target("prefill", 1)
        wait_for(lambda: live_ids(manager, Pool.PREFILL) == prefill_before, 60, "the new prefill replica to go")
    finally:
        targets.set_target("decode", 1)
        targets.set_target("prefill", 1)
        conn.close()


def test_an_idle_replica_scaled_down_stays_up_refusing_work_until_routing_has_seen_it_drain(manager: PoolManager):
    """Routing reads the registry every 0.2 s (longer on a loaded host). An idle replica stopped the moment it
    was marked draining failed requests routed on an older snapshot as lost (each a migration, or a 503);
    it now stays up, refusing new work, for two seconds after routing can see it draining."""
    conn = connect(manager.redis_url, manager.prefix)
    targets, registry = PoolTargets(conn), WorkerRegistry(conn)
    try:
        targets.set_target("prefill", 2)
        wait_for(lambda: len(manager.replicas("prefill")) == 2, 120, "a second prefill replica")
        victim = manager.replicas("prefill")[-1]
        targets.set_target("prefill", 1)
        draining_at = gone_at = None
        deadline = time.monotonic() + 60
        while gone_at is None and time.monotonic() < deadline:
            record = registry.get(victim.worker_id, "prefill")
            if record is None and draining_at is not None:
                gone_at = time.monotonic()
            elif record is not None and record.info.draining and draining_at is None:
                draining_at = time.monotonic()
            time.sleep(0.01)
        assert draining_at is not None and gone_at is not None, "the replica should be seen draining, then gone"
        assert gone_at - draining_at >= 1.9, gone_at - draining_at
    finally:
        targets.set_target("prefill", 1)
        conn.close()


def test_a_dropped_target_cancels_a_whole_wave_of_starts_at_once(redis_server: LocalRedis, tmp_path: Path):
    """60 replicas that can never be placed (64 CPUs each of a 2-CPU Ray) start as one wave. When the target
    drops to 0, every start left is cancelled and start() returns: each used to wait a second before it
    looked at the target, so these took a minute (a thousand, after a mistyped `epd scale`, held up Ctrl-C
    that long). The bound below is for a hang, ten times what it takes. On the way, the targets a restarted
    private Redis is given back (``rewrite_targets``) keep the scale-up under way."""
    prefix = f"pools-wave-{uuid.uuid4().hex[:8]}"
    greedy = Settings(model=tmp_path, encode={"replicas": 60, "num_cpus": 64}, prefill={"replicas": 0},
                      decode={"replicas": 0}, transfer={"codec_policy": "fp32", "token": TOKEN})
    m = PoolManager(greedy, redis_server.url, prefix, TOKEN, start_timeout_s=600)
    errors: list[BaseException] = []
    done = threading.Event()

    def start() -> None:
        try:
            m.start()
        except BaseException as exc:  # the assertion below names it
            errors.append(exc)
        finally:
            done.set()

    threading.Thread(target=start, daemon=True).start()
    conn = connect(redis_server.url, prefix)
    try:
        wait_for(lambda: PoolTargets(conn).get_target(Pool.ENCODE) == 60, 30, "the configured target")
        time.sleep(2.0)  # the wave's actors are asked of Ray, and its first start waits
        # meanwhile a restarted private Redis (empty) is given back the targets the manager knew: the
        # scale-up under way, not the replicas that serve so far
        assert m.last_target(Pool.ENCODE) == 60 and m.replicas("encode") == ()
        for pool in Pool:
            PoolTargets(conn).clear_target(pool)
        rewrite_targets(conn, m)
        assert [PoolTargets(conn).get_target(p) for p in (Pool.ENCODE, Pool.PREFILL, Pool.DECODE)] == [60, 0, 0]
        PoolTargets(conn).set_target(Pool.ENCODE, 0)
        assert done.wait(30), "start() still waits on starts the target no longer wants"
        assert not errors, errors
        assert m.replicas("encode") == ()
    finally:
        m.stop()
        for pool in Pool:
            PoolTargets(conn).clear_target(pool)
        conn.close()


def test_a_replica_that_cannot_start_says_why(redis_server: LocalRedis, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch):
    prefix = f"pools-bad-{uuid.uuid4().hex[:8]}"
    bad = PoolManager(pool_settings(tmp_path / "no-such-model", prefill=0, decode=0), redis_server.url, prefix,
                      TOKEN, start_timeout_s=120)
    with pytest.raises(WorkerStartError, match="not a checkpoint folder"):
        bad.start()  # joins the module's Ray (already initialised here) and leaves it running
    assert ray.is_initialized()
    greedy = Settings(model=tmp_path, encode={"replicas": 1, "num_cpus": 64}, prefill={"replicas": 0},
                      decode={"replicas": 0}, transfer={"codec_policy": "fp32", "token": TOKEN})
    unplaceable = PoolManager(greedy, redis_server.url, prefix, TOKEN, start_timeout_s=2)
    with pytest.raises(WorkerStartError, match="did not start within 2 s"):
        unplaceable.start()  # 64 CPUs asked of a 2-CPU Ray: pending until the timeout, then killed
    other_image = Settings(model=None, encode={"replicas": 1, "num_cpus": 0.25}, prefill={"replicas": 0},
                           decode={"replicas": 0}, transfer={"codec_policy": "fp32", "token": TOKEN})
    monkeypatch.setattr("controlplane.pools.manager.wire_digest", lambda: "0123456789ab")  # this side only
    with pytest.raises(WorkerStartError, match=r"WireMismatch: this encode replica runs epd code that speaks "
                                               r"another wire protocol \([0-9a-f]{12}\) than the control plane "
                                               r"\(0123456789ab\): its Ray node runs another epd image"):
        PoolManager(other_image, redis_server.url, prefix, TOKEN, start_timeout_s=120).start()
    monkeypatch.undo()
    if not torch.cuda.is_available():  # a cuda replica on a host whose torch has none says so in words
        on_cuda = Settings(model=tmp_path, encode={"replicas": 1, "num_cpus": 0.25, "engine": {"device": "cuda"}},
                           prefill={"replicas": 0}, decode={"replicas": 0},
                           transfer={"codec_policy": "fp32", "token": TOKEN})
        with pytest.raises(WorkerStartError, match="device cuda: CUDA is not available here"):
            PoolManager(on_cuda, redis_server.url, prefix, TOKEN, start_timeout_s=120).start()
    conn = connect(redis_server.url, prefix)
    try:
        assert [k for k in keys_under(conn) if ":pool:" not in k] == []  # no lease left by the failed replica
        for pool in Pool:
            PoolTargets(conn).clear_target(pool)
    finally:
        conn.close()


def test_rays_world_writable_folders_sit_inside_a_private_one(manager: PoolManager):
    """Ray makes its folders 0777 without the sticky bit; another local user who can enter them can swap the
    token file or a socket, or plant a symlink where Ray rewrites a log (the stack then overwrites a file of
    their choosing). They sit inside the control plane's own 0700 folder, which no other user can enter."""
    temp_dir = manager.runtime.temp_dir
    assert temp_dir is not None
    assert stat.S_IMODE(temp_dir.stat().st_mode) == 0o700
    sessions = list((temp_dir / "r").glob("session_*"))
    assert sessions and all(s.is_relative_to(temp_dir) for s in sessions)  # Ray's tree is under it
    assert (temp_dir / "auth_token").exists() and stat.S_IMODE((temp_dir / "auth_token").stat().st_mode) == 0o600


def test_stop_leaves_no_process_behind(manager: PoolManager):
    actor_pids = [pid for pool in Pool for pid in pids(manager, pool).values()]
    assert len(actor_pids) == 3
    temp_dir = manager.runtime.temp_dir
    assert temp_dir is not None and temp_dir.is_dir()
    manager.stop()
    assert not ray.is_initialized()
    wait_for(lambda: all(gone(pid) for pid in actor_pids), 30, f"actor processes {actor_pids} to exit")
    ours = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and entry.name != str(os.getpid()):
            try:
                cmdline = (entry / "cmdline").read_bytes().decode(errors="replace")
            except OSError:
                continue
            if str(temp_dir) in cmdline and not gone(int(entry.name)):
                ours.append((entry.name, cmdline.replace("\0", " ")[:200]))
    assert ours == [], f"Ray processes still running: {ours}"
    assert not temp_dir.exists()
    conn = connect(manager.redis_url, manager.prefix)
    try:  # leases gone; the targets (and what the settings asked) stay, as desired state
        assert sorted(keys_under(conn)) == sorted([conn.keys.pool_target(p) for p in Pool]
                                                  + [conn.keys.pool_configured(p) for p in Pool])
        for pool in Pool:
            PoolTargets(conn).clear_target(pool)
    finally:
        conn.close()
