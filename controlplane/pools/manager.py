"""Runs the encode, prefill and decode pools as Ray actors and keeps each at its target in Redis.

Lifecycle of a manager:
  1. ``start()``     Ray (``RayRuntime``); on a cluster joined at an address, the replicas a previous manager
                     of this deployment left running are adopted (``_adopt``); each pool's target set from
                     settings (an ``epd scale`` made since the last start with the same settings is kept),
                     every pool reconciled, then a reconcile loop thread per pool started. A start that fails stops
                     what it started and leaves what it adopted serving (the next manager adopts it again).
  2. running         ``scale(pool, n)`` writes the target and reconciles that pool now. Each pool's loop, every
                     ``reconcile_interval_s``, reconciles it when its lock is free (one pool's drain or start
                     holds up no other's, but replicas sharing a GPU start one at a time whatever their
                     pool): it reads the target from Redis (so ``epd scale`` in another process, which only
                     writes the target, takes effect) and replaces replicas that died.
  3. ``stop()``      the loops end, every actor this manager holds is stopped and killed, Ray is shut
                     down if ``start`` initialised it. Idempotent.

Surviving the manager: on a cluster joined at an address (Kubernetes), replicas are detached Ray actors, so
a manager that dies without ``stop()`` (OOM-killed, its node lost) leaves them serving their leases. The
next manager of the same deployment (Redis URL and prefix, a digest of both in each replica's name) finds
them by name and adopts each whose ``launch_key`` (pool, model, settings but the replica counts, token,
Redis) equals its own: no model loads again. One of this deployment started with anything else, or that
does not answer, is stopped and killed; another deployment's are never touched. Each replica's ``watch``
call returns every ``WATCH_S`` and is made again, so a dead manager's holds none of its threads for long.
A private Ray (no address) dies with its manager, and its replicas stay ordinary actors.
Listeners (``listen``) hear each replica's address when it starts serving and when it is gone for good
(killed: dead, hung, scaled down or stopped; after its deregistration), so the dispatcher can drop what it
holds for a worker that will not come back.

Reconciling one pool (under that pool's lock only, so pools never touch each other):
  1. replicas whose actor exited, or whose lease expired while the actor fails a probe, are killed;
  2. too few: new actors start together; each must answer ``info`` and hold a live lease before
     ``start_timeout_s``, else ``WorkerStartError`` carries the actor's exception text;
  3. too many: the newest replicas drain (routing skips them, in-flight requests and reservations
     finish, at most ``drain_timeout_s``), then stop, then their actors are killed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import ray
from ray.actor import ActorHandle

from controlplane.pools import launch
from controlplane.pools.actor import WATCH_CONCURRENCY, WATCH_GROUP, WorkerActor
from controlplane.pools.pending import explain
from controlplane.pools.ray_runtime import RayRuntime
from controlplane.pools.replica import WireMismatch, check_wire, wire_digest
from controlplane.pools.status import PendingReplica, PoolStatus, ReplicaStatus, WorkerStartError
from controlplane.settings import PoolSettings, Settings
from controlplane.state import Pool, PoolTargets, StateConnection, StateError, WorkerRegistry, connect
from controlplane.state.pools import validate_replicas

log = logging.getLogger(__name__)

PROBE_TIMEOUT_S = 5.0
STOP_TIMEOUT_S = 30.0
ACTOR_CONCURRENCY = 4  # info, status, drain and stop (watch() has its own group: actor.WATCH_GROUP)
WATCH_S = 30.0  # a watch() call returns after this long and is made again: a dead manager's frees its thread
MAX_RETRY_DELAY_S = 30.0
# _start_wave's names: <prefix>-<pool>-<deployment>-<manager uid>-<index>
_ACTOR_NAME = re.compile(
    r"(?P<prefix>.+)-(?P<pool>encode|prefill|decode)-(?P<deployment>[0-9a-f]{8})-[0-9a-f]{6}-[0-9]+")


@dataclass(frozen=True)
class Replica:
    """An actor this manager started, once it is serving."""

    pool: Pool
    name: str  # the Ray actor name, in the settings' Ray namespace
    worker_id: str
    address: str
    actor: ActorHandle = field(repr=False, compare=False)
    started_at: float  # time.monotonic()
    watch: ray.ObjectRef = field(repr=False, compare=False)  # resolves when the actor stops or dies


class AddressListener(Protocol):
    """Hears of replicas' addresses as they come and go. Called on the manager's threads: must not block;
    an exception it raises is logged and ignored."""

    def serving(self, address: str) -> None:
        """A replica started serving at ``address``."""

    def forget(self, address: str) -> None:
        """The replica at ``address`` is gone for good (its actor killed, its lease deregistered)."""


class PoolManager:
    """The pools of one deployment: actors in Ray, targets and leases in Redis under ``prefix``.

    ``token`` is the transfer credential every worker checks. ``ray_address`` (else ``settings.ray.address``)
    joins a cluster; with neither, a private local Ray is started. Timeouts are seconds; ``drain_timeout_s``
    defaults to ``settings.scheduler.request_timeout_s`` (the longest a request may run).
    ``registry`` and ``targets`` exist once ``start()`` ran.
    """

    def __init__(self, settings: Settings, redis_url: str, prefix: str, token: str,
                 ray_address: str | None = None, *, start_timeout_s: float | None = None,
                 drain_timeout_s: float | None = None, reconcile_interval_s: float = 1.0) -> None:
        self.settings = settings
        self.redis_url = redis_url
        self.prefix = prefix
        self.start_timeout_s = start_timeout_s if start_timeout_s is not None else settings.ray.replica_start_timeout_s
        self.drain_timeout_s = drain_timeout_s if drain_timeout_s is not None else settings.scheduler.request_timeout_s
        self.reconcile_interval_s = reconcile_interval_s
        self.runtime = RayRuntime(ray_address if ray_address is not None else settings.ray.address,
                                  settings.ray.namespace, loopback_only=settings.ray.loopback_only)
        self._token = token
        self._settings_json = launch.replica_settings_json(settings)
        self._model_dir = str(settings.model) if settings.model is not None else ""  # "": the actor resolves it
        # this deployment (its Redis and prefix): the only replicas a manager adopts or stops at start
        self._deployment = hashlib.sha256(f"{redis_url}\0{prefix}".encode()).hexdigest()[:8]
        counts_apart = settings.model_dump_json(exclude={**launch.NOT_FOR_REPLICAS,
                                                         **{p.value: {"replicas"} for p in Pool}})
        self._launch = {p: launch.launch_key(p.value, self._model_dir, counts_apart, token, redis_url, prefix)
                        for p in Pool}
        self._wire = wire_digest()  # a replica whose code speaks another protocol is refused (``_check_wire``)
        self._detached = self.runtime.address is not None  # a cluster that outlives this manager
        self._uid = uuid.uuid4().hex[:6]
        self._replicas: dict[Pool, list[Replica]] = {p: [] for p in Pool}
        self._locks = {p: threading.Lock() for p in Pool}
        # Replicas that share a GPU start one after another, whichever pools they serve (``_start_replicas``);
        # the pools' loops run apart.
        self._gpu_start = threading.Lock()
        self._next_index = {p: 0 for p in Pool}
        self._retry_at = {p: 0.0 for p in Pool}
        self._failures = {p: 0 for p in Pool}
        self._stop = threading.Event()
        self._loops: list[threading.Thread] = []  # one per pool: a long drain or start holds up no other pool
        self._conn: StateConnection | None = None
        self._remote_cls: Any = None  # ray.remote(WorkerActor), made once Ray is up
        self._starting: dict[Pool, dict[str, float]] = {p: {} for p in Pool}  # actor name -> monotonic asked at
        self._queued = {p: 0 for p in Pool}  # replicas sharing a GPU waiting for the one starting before them
        self._problem: dict[Pool, str | None] = {p: None for p in Pool}  # the last failed start, until one works
        self._seen_target: dict[Pool, int] = {}  # each pool's target as last read from or written to Redis
        self._adopted: set[str] = set()  # worker ids adopted by a start still under way
        self._stopping: set[str] = set()  # worker ids a scale-down is draining and stopping
        self._suspects: set[str] = set()  # worker ids routing lost a request on, probed at the next reconcile
        self._suspects_lock = threading.Lock()
        self._listeners: list[AddressListener] = []

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> PoolManager:
        """Ray up, targets from settings (unless only an ``epd scale`` changed them since the last start: see
        ``PoolTargets.apply_configured``), every pool at its target. On any failure everything started is
        stopped again and the error raised (``WorkerStartError`` names each replica that failed)."""
        self._conn = connect(self.redis_url, self.prefix)
        self.registry = WorkerRegistry(self._conn, ttl=self.settings.redis.heartbeat_ttl_s)
        self.targets = PoolTargets(self._conn)
        try:
            self.runtime.start()
            self._remote_cls = ray.remote(concurrency_groups={WATCH_GROUP: WATCH_CONCURRENCY})(WorkerActor)
            if self._detached:
                self._adopt()
            for pool in Pool:
                self.targets.apply_configured(pool, self.settings.pool(pool.value).replicas)
            for pool in Pool:
                self.reconcile(pool)
        except BaseException:
            self._let_go_adopted()
            self.stop()
            raise
        self._adopted.clear()  # from here on they are this manager's, stopped with it
        for pool in Pool:
            loop = threading.Thread(target=self._run_loop, args=(pool,), name=f"pool-reconcile-{pool.value}",
                                    daemon=True)
            loop.start()
            self._loops.append(loop)
        return self

    def _adopt(self) -> None:
        """Take over the replicas of this deployment (named ``<prefix>-<pool>-...`` in the Ray namespace) that
        a manager which died left running: each whose launch key is this manager's for its pool and that
        holds its lease, as if this manager had started it; the others are stopped and killed."""
        namespace = self.settings.ray.namespace
        try:
            names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
                           if a["namespace"] == namespace)
        except Exception as exc:  # Ray's listing unavailable: start fresh replicas as before
            log.warning("could not list the running replicas to adopt them: %s", exc)
            return
        for name in names:
            m = _ACTOR_NAME.fullmatch(name)
            if m is None or m["prefix"] != self.prefix or m["deployment"] != self._deployment:
                continue  # another deployment's (its own Redis or prefix): never touched
            pool = Pool(m["pool"])
            try:
                actor = ray.get_actor(name, namespace=namespace)
            except ValueError:  # gone since the listing
                continue
            try:
                info = ray.get(actor.info.remote(), timeout=PROBE_TIMEOUT_S)
            except Exception as exc:  # still starting when its manager died, or hung
                log.warning("%s replica %s left by an earlier manager does not answer (%s); killing it",
                            pool.value, name, type(exc).__name__)
                _kill_quietly(actor)
                continue
            started = time.monotonic() - max(0.0, time.time() - float(info.get("serving_at", time.time())))
            replica = Replica(pool, name, info["worker_id"], info["address"], actor, started,
                              actor.watch.remote(WATCH_S))
            if info.get("launch") != self._launch[pool] or info.get("wire") != self._wire:
                log.info("%s replica %s (%s) was started with other settings, model, credentials or epd code; "
                         "stopping it", pool.value, name, info["worker_id"])
                self._stop_replicas([replica])
            elif not self._answers(replica):
                log.warning("%s replica %s (%s) holds no lease; killing it", pool.value, name, info["worker_id"])
                self._kill(replica)
            else:
                self._replicas[pool].append(replica)
                self._adopted.add(replica.worker_id)
                log.info("%s replica %s (%s) adopted, serving at %s", pool.value, name, info["worker_id"],
                         info["address"])
        for pool in Pool:
            self._replicas[pool].sort(key=lambda r: r.started_at)

    def _let_go_adopted(self) -> None:
        """A failed start leaves the replicas it adopted serving (it did not start them), for the next manager
        of this deployment to adopt again: a control plane that cannot start one more replica in time does not
        take down the ones that were serving."""
        for pool in Pool:
            with self._locks[pool]:
                kept = [r for r in self._replicas[pool] if r.worker_id in self._adopted]
                self._replicas[pool] = [r for r in self._replicas[pool] if r.worker_id not in self._adopted]
            for r in kept:
                log.warning("the start failed: leaving adopted %s replica %s (%s) serving for the next control "
                            "plane", pool.value, r.name, r.worker_id)
        self._adopted.clear()

    def stop(self) -> None:
        """Stop the loops and every actor this manager holds (no drain), then Ray if we started it."""
        self._stop.set()
        for loop in self._loops:
            loop.join(STOP_TIMEOUT_S)
        self._loops = []
        for pool in Pool:
            with self._locks[pool]:
                victims, self._replicas[pool] = self._replicas[pool], []
                self._stop_replicas(victims)
        self.runtime.stop()
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    def listen(self, listener: AddressListener) -> None:
        """Tell ``listener`` of every replica that starts serving or is gone for good from now on."""
        self._listeners.append(listener)

    def __enter__(self) -> PoolManager:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ operator API
    def scale(self, pool: Pool | str, replicas: int) -> None:
        """Set ``pool``'s target and bring the pool to it now; scaling down drains first."""
        pool = Pool(pool)
        validate_replicas(replicas)
        if self.settings.mode == "colocated" and pool is not Pool.DECODE and replicas:
            raise ValueError(f"colocated mode has no {pool.value} pool; scale the decode pool")
        self.targets.set_target(pool, replicas)
        self._seen_target[pool] = replicas
        self.reconcile(pool)

    def last_target(self, pool: Pool | str) -> int:
        """``pool``'s target as this manager last read or wrote it in Redis (before any: the replicas it holds).
        A restarted private Redis is given these back, so a scale-up under way is not undone."""
        pool = Pool(pool)
        return self._seen_target.get(pool, len(self._replicas[pool]))

    def replicas(self, pool: Pool | str) -> tuple[Replica, ...]:
        """The serving actors this manager holds for ``pool``, oldest first."""
        return tuple(self._replicas[Pool(pool)])

    def status(self) -> list[PoolStatus]:
        """Per pool, in pool order: target, actors held, and live workers in the registry."""
        out = []
        for pool in Pool:
            mine = {r.worker_id for r in self._replicas[pool]}
            live = tuple(ReplicaStatus.from_record(rec, rec.info.worker_id in mine)
                         for rec in self.registry.live_workers(pool))
            out.append(PoolStatus(pool, self.targets.get_target(pool), len(mine), live))
        return out

    def needs(self, pool: Pool | str) -> dict[str, float]:
        """The Ray resources one replica of ``pool`` asks for (name -> amount; zero amounts left out)."""
        ps = self.settings.pool(Pool(pool).value)
        asked = {"CPU": ps.num_cpus, "GPU": ps.num_gpus, **ps.ray_resources}
        return {k: float(v) for k, v in asked.items() if v > 0}

    def pending(self, pool: Pool | str) -> tuple[PendingReplica, ...]:
        """Replicas of ``pool`` asked of Ray and not serving yet, oldest first, each with its reason
        (``pending.explain``), then those queued behind them (replicas sharing a GPU start one after another).
        Without Ray (stopped) nothing is pending."""
        pool = Pool(pool)
        starting = list(self._starting[pool].items())
        if not ray.is_initialized():
            return ()
        queued = tuple(PendingReplica(f"{pool.value} replica (queued {i + 1})", 0.0, self.needs(pool), False,
                                      "queued: replicas sharing a GPU start one after another")
                       for i in range(self._queued[pool]))
        if not starting:  # none asked of Ray yet: those waiting for another pool's replica to start, if any
            return queued
        try:
            total, free = ray.cluster_resources(), ray.available_resources()
        except Exception:  # Ray going away under us: say nothing rather than fail a status call
            return ()
        held: dict[str, float] = {}
        for p in Pool:
            for k, v in self.needs(p).items():
                held[k] = held.get(k, 0.0) + v * len(self._replicas[p])
        return explain(starting, self.needs(pool), held, total, free, time.monotonic()) + queued

    def problem(self, pool: Pool | str) -> str | None:
        """The last failed start of ``pool``'s replicas (first line), until a start succeeds."""
        return self._problem[Pool(pool)]

    def stopping(self, worker_id: str) -> bool:
        """Whether a scale-down is draining ``worker_id`` to stop it (so it must not take work again)."""
        return worker_id in self._stopping

    # ------------------------------------------------------------------ reconciling
    def reconcile(self, pool: Pool | str) -> None:
        """Bring one pool to its target (blocking while it drains). Raises ``WorkerStartError``."""
        pool = Pool(pool)
        with self._locks[pool]:
            self._reconcile_locked(pool)

    def _reconcile_locked(self, pool: Pool) -> None:
        self._remove_dead(pool)
        target = self._read_target(pool)
        if target is None:
            return
        if self.settings.mode == "colocated" and pool is not Pool.DECODE:
            target = 0  # whatever Redis says: colocated mode runs the decode pool only
        have = len(self._replicas[pool])
        if have < target:
            self._start_replicas(pool, target - have)
        elif have > target:
            # drained replicas (epd drain) go first, then the newest: a scale-down must never stop a routable
            # replica and keep one that takes no new work
            draining = {rec.info.worker_id for rec in self.registry.live_workers(pool) if rec.info.draining}
            ordered = sorted(self._replicas[pool], key=lambda r: (r.worker_id in draining, r.started_at))
            victims = ordered[target:]
            self._stopping.update(r.worker_id for r in victims)  # before they leave the replica list
            self._replicas[pool] = ordered[:target]
            self._drain_and_stop(victims)

    def _read_target(self, pool: Pool) -> int | None:
        target = self.targets.get_target(pool)
        if target is not None:
            self._seen_target[pool] = target
        return target

    def _run_loop(self, pool: Pool) -> None:
        """Reconcile ``pool`` every interval, in its own thread: one pool's drain (up to the request timeout)
        or replica start (up to the start timeout) must not hold up another's, such as the replacement of a
        dead replica."""
        while not self._stop.wait(self.reconcile_interval_s):
            if time.monotonic() < self._retry_at[pool]:
                continue
            if not self._locks[pool].acquire(blocking=False):
                continue  # scale() is working on this pool
            try:
                self._reconcile_locked(pool)
                self._failures[pool] = 0
            except StateError as exc:
                log.warning("reconcile %s: Redis unavailable: %s", pool.value, exc)
            except Exception as exc:  # a failed start: retry later, backing off
                self._failures[pool] += 1
                delay = min(MAX_RETRY_DELAY_S, 2.0 ** self._failures[pool])
                self._retry_at[pool] = time.monotonic() + delay
                log.error("reconcile %s failed (retry in %.0f s): %s", pool.value, delay, exc)
            finally:
                self._locks[pool].release()

    def suspect(self, worker_id: str) -> None:
        """Routing lost a request on this worker (its stream broke, or it went silent): the next reconcile
        probes it at once, instead of after its lease runs out, and replaces it if it does not answer."""
        with self._suspects_lock:
            self._suspects.add(worker_id)

    def _probe_fails(self, r: Replica) -> bool:
        try:
            ray.get(r.actor.status.remote(), timeout=PROBE_TIMEOUT_S)
        except Exception:
            return True
        return False

    def _remove_dead(self, pool: Pool) -> None:
        replicas = self._replicas[pool]
        if not replicas:
            return
        returned, _ = ray.wait([r.watch for r in replicas], num_returns=len(replicas), timeout=0)
        returned_refs, exited_refs = set(returned), set()
        for r in [r for r in replicas if r.watch in returned_refs]:
            try:
                stopped = ray.get(r.watch, timeout=PROBE_TIMEOUT_S) == "stopped"
            except Exception:  # its process died
                stopped = True
            if stopped:
                exited_refs.add(r.watch)
            else:  # the watch's time ran out while it serves: watch again
                self._replicas[pool][self._replicas[pool].index(r)] = dataclasses.replace(
                    r, watch=r.actor.watch.remote(WATCH_S))
        replicas = self._replicas[pool]
        live = {rec.info.worker_id for rec in self.registry.live_workers(pool)}
        with self._suspects_lock:
            suspects = {r.worker_id for r in replicas} & self._suspects
            self._suspects -= suspects
        dead = [r for r in replicas if r.watch in exited_refs
                or (r.worker_id in suspects and self._probe_fails(r))
                or (r.worker_id not in live and not self._answers(r))]
        for r in dead:
            log.warning("%s replica %s (%s) died; replacing it", pool.value, r.name, r.worker_id)
            self._replicas[pool].remove(r)
            self._kill(r)

    def _answers(self, r: Replica) -> bool:
        """Whether a replica without a lease is alive and keeps its lease: after Redis was away (or
        restarted) its next beat registers it again, so it is given one beat before it counts as dead."""
        try:
            s = ray.get(r.actor.status.remote(), timeout=PROBE_TIMEOUT_S)
        except Exception:
            return False
        if s["heartbeat_ok"]:
            return True
        if not s["heartbeat_running"]:
            return False
        time.sleep(self.registry.ttl / 3 + 0.5)
        return self.registry.get(r.worker_id, r.pool) is not None

    # ------------------------------------------------------------------ starting
    def _start_replicas(self, pool: Pool, n: int) -> None:
        ps = self.settings.pool(pool.value)
        # Replicas that share a GPU start one after another, across pools too: each sizes its KV pool from what
        # the GPU holds (workers.runtime.gpu_memory), and another loading beside it would count against it.
        waves = [1] * n if ps.shares_gpu else [n]
        errors: list[str] = []
        try:
            for i, size in enumerate(waves):
                if i and (errors or not self._wants_more(pool)):
                    why = "a start failed" if errors else "the manager stops, or the target dropped"
                    log.info("%s: %d replica start(s) not begun (%s)", pool.value, n - i, why)
                    break
                if not ps.shares_gpu:
                    errors += self._start_wave(pool, ps, size)
                    continue
                self._queued[pool] = len(waves) - i  # this wave too, while another pool's replica starts
                with self._gpu_start:
                    if not self._wants_more(pool):  # dropped, or stopping, while another pool's replica started
                        log.info("%s: %d replica start(s) not begun (the manager stops, or the target dropped)",
                                 pool.value, n - i)
                        break
                    self._queued[pool] = len(waves) - i - 1  # after this wave
                    errors += self._start_wave(pool, ps, size)
        finally:
            self._queued[pool] = 0
        if errors:
            self._problem[pool] = (f"{len(errors)} of {n} replicas failed to start; last: "
                                   f"{errors[-1].splitlines()[0]}")
            raise WorkerStartError(f"{len(errors)} of {n} {pool.value} replicas failed to start:\n"
                                   + "\n".join(errors))
        self._problem[pool] = None

    def _wants_more(self, pool: Pool) -> bool:
        """Whether the manager runs and ``pool``'s target is above what serves (Redis away: assumed so)."""
        if self._stop.is_set():
            return False
        try:
            target = self._read_target(pool)
        except StateError:
            return True
        return target is None or target > len(self._replicas[pool])

    def _start_wave(self, pool: Pool, ps: PoolSettings, n: int) -> list[str]:
        """Start ``n`` replicas at once and wait for each to serve; what failed, one line per replica."""
        host = "127.0.0.1" if self.runtime.temp_dir is not None else ""  # "": the actor's own node IP
        pending = []
        for _ in range(n):
            index = self._next_index[pool]
            self._next_index[pool] += 1
            name = f"{self.prefix}-{pool.value}-{self._deployment}-{self._uid}-{index}"
            actor = self._remote_cls.options(
                name=name, namespace=self.settings.ray.namespace, max_concurrency=ACTOR_CONCURRENCY, max_restarts=0,
                lifetime="detached" if self._detached else None, **launch.placement_options(ps),
            ).remote(pool.value, self._model_dir, self._settings_json, self._token, self.redis_url,
                     self.prefix, index, host, self._launch[pool], wire=self._wire)
            pending.append((name, actor, actor.info.remote()))
            self._starting[pool][name] = time.monotonic()
        deadline = time.monotonic() + self.start_timeout_s
        errors: list[str] = []
        placed: set[str] = set()
        try:
            for i, (name, actor, info_ref) in enumerate(pending):
                try:
                    info = self._await_start(pool, info_ref, deadline, len(pending) - i)
                    self._check_wire(info)
                    self._await_lease(pool, info["worker_id"], deadline)
                except _Cancelled as why:
                    log.info("%s replica %s: start cancelled (%s)", pool.value, name, why)
                    _kill_quietly(actor)
                    continue
                except Exception as exc:
                    failure = launch.describe_start_failure(exc, ps.num_cpus, ps.num_gpus, self.start_timeout_s)
                    errors.append(f"{name}: {failure}{launch.disk_hint(self.runtime.temp_dir)}")
                    if isinstance(exc, WireMismatch):  # it serves already: stopped, so it leaves no lease
                        _stop_quietly(actor)
                    _kill_quietly(actor)
                    continue
                finally:
                    self._starting[pool].pop(name, None)
                self._replicas[pool].append(Replica(pool, name, info["worker_id"], info["address"], actor,
                                                    time.monotonic(), actor.watch.remote(WATCH_S)))
                placed.add(name)
                for listener in self._listeners:
                    _tell(listener.serving, info["address"])
                log.info("%s replica %s serving at %s", pool.value, name, info["address"])
        except BaseException:  # interrupted (Ctrl-C, SIGTERM): no actor of this wave outlives it unheld
            for name, actor, _ in pending:
                if name not in placed:
                    _kill_quietly(actor)
            raise
        finally:
            for name, _, _ in pending:
                self._starting[pool].pop(name, None)
        return errors

    def _check_wire(self, info: dict) -> None:
        """Refuse a replica whose own code speaks another wire protocol than this control plane's: its Ray
        node runs another epd image (KubeRay leaves running pods on their image when the RayCluster's
        changes), and their messages would mean different things to each side. (A replica of this code
        refuses itself before it registers; one of older code that took no ``wire`` is caught here.)"""
        check_wire(info.get("wire"), self._wire, "its process")

    def _await_start(self, pool: Pool, info_ref: ray.ObjectRef, deadline: float, unfinished: int) -> dict:
        """The replica's ``info`` once it serves. Gives up (``_Cancelled``) as soon as the manager stops or the
        pool's target drops to what serves already plus fewer than ``unfinished`` starts, so a replica that
        cannot be placed never holds up a stop or a scale-down until its deadline. The first look does not
        wait: once a target drops, each start left in a wave is cancelled at once, not after a second each
        (a wave of a thousand took that many seconds, and held up stop() as long)."""
        wait_s = 0.0
        while True:
            ready, _ = ray.wait([info_ref], timeout=wait_s)
            if ready or time.monotonic() >= deadline:
                return ray.get(info_ref, timeout=0.1)  # the answer, the actor's error, or GetTimeoutError
            wait_s = max(0.0, min(1.0, deadline - time.monotonic()))
            if self._stop.is_set():
                raise _Cancelled("the pool manager is stopping")
            try:
                target = self._read_target(pool)
            except StateError:
                continue  # Redis away: keep waiting for the start
            if target is not None and target < len(self._replicas[pool]) + unfinished:
                raise _Cancelled(f"the target dropped to {target}")

    def _await_lease(self, pool: Pool, worker_id: str, deadline: float) -> None:
        while self.registry.get(worker_id, pool) is None:
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {worker_id} answered but holds no live lease in Redis")
            time.sleep(0.05)

    # ------------------------------------------------------------------ stopping
    def _drain_and_stop(self, victims: list[Replica]) -> None:
        try:
            drains = _send_each(victims, "drain", lambda r: r.actor.drain.remote(self.drain_timeout_s))  # all at once
            for r, ref in drains:
                try:
                    clean = ref is not None and ray.get(ref, timeout=self.drain_timeout_s + PROBE_TIMEOUT_S)
                except Exception as exc:
                    clean = False
                    log.warning("drain of %s failed: %s", r.worker_id, exc)
                if not clean:
                    log.warning("%s stops with work still in flight", r.worker_id)
            self._stop_replicas(victims)
        finally:
            self._stopping.difference_update(r.worker_id for r in victims)

    def _stop_replicas(self, victims: list[Replica]) -> None:
        for r, ref in _send_each(victims, "stop", lambda r: r.actor.stop.remote()):
            if ref is not None:
                try:
                    ray.get(ref, timeout=STOP_TIMEOUT_S)
                except Exception as exc:
                    log.warning("stop of %s failed: %s", r.worker_id, exc)
            self._kill(r)

    def _kill(self, r: Replica) -> None:
        _kill_quietly(r.actor)
        try:
            self.registry.deregister(r.worker_id, r.pool)  # a crashed actor could not do it itself
        except StateError as exc:
            log.warning("could not deregister %s: %s", r.worker_id, exc)
        if any(x.address == r.address for p in Pool for x in self._replicas[p]):
            return  # a replica started since on the dead one's freed port serves there: not gone
        for listener in self._listeners:
            _tell(listener.forget, r.address)


class _Cancelled(Exception):
    """A replica's start given up on purpose (the manager stops, or the target dropped)."""


def _tell(hear: Callable[[str], None], address: str) -> None:
    try:
        hear(address)
    except Exception:  # a listener's trouble never stops a reconcile
        log.exception("a replica listener failed on %s", address)


def _send_each(victims: list[Replica], what: str, call: Callable[[Replica], Any]) -> list[tuple[Replica, Any]]:
    """(replica, the ref ``call`` returned) for each; None where the call could not be sent because Ray itself
    is gone (a restarted head, a lost client), which is logged: the replica is stopped all the same."""
    sent: list[tuple[Replica, Any]] = []
    for r in victims:
        try:
            sent.append((r, call(r)))
        except Exception as exc:
            log.warning("%s of %s not sent: %s", what, r.worker_id, exc)
            sent.append((r, None))
    return sent


def _stop_quietly(actor: ActorHandle) -> None:
    """The replica's own stop (its lease deregistered, its server stopped), if it answers in time."""
    try:
        ray.get(actor.stop.remote(), timeout=STOP_TIMEOUT_S)
    except Exception as exc:
        log.debug("stop: %s", exc)


def _kill_quietly(actor: ActorHandle) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # already gone
        log.debug("kill: %s", exc)
