"""The composition root: ``epd serve`` builds the whole deployment from one Settings.

  1. Redis       the configured URL, or a private redis-server started here (and stopped on exit).
  2. Credentials the transfer token (configured, or generated for this run) and the admin token
                 (configured, or generated once into a file only this user can read).
  3. Pools       a PoolManager starts (or joins) Ray and runs each pool's replicas as actors.
  4. Scheduler   routing over the Redis registry, admission, dispatch over the worker services.
  5. API         the OpenAI-compatible ingress plus the admin router, served by uvicorn.
Ctrl-C (or SIGTERM) stops them in reverse order; nothing is left running.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import secrets
import signal
import socket
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from controlplane.backend import ModelInfo
from controlplane.cli_args import UsageError
from controlplane.settings import Settings, SettingsError

if TYPE_CHECKING:
    from controlplane.pools.manager import PoolManager
    from controlplane.state.client import StateConnection

log = logging.getLogger(__name__)


def model_info(settings: Settings, model_dir: Path) -> ModelInfo:
    """What the ingress needs about the model, read without loading any weights."""
    from workers.runtime.config import ModelConfig
    from workers.runtime.loader import image_input, read_generation_eos
    from workers.runtime.tokenizer import Tokenizer

    cfg = ModelConfig.from_file(model_dir / "config.json")
    tokenizer = Tokenizer.from_folder(model_dir)
    limit = settings.decode.engine.max_model_len or cfg.max_position_embeddings
    images = image_input(model_dir, tokenizer)  # None: a text-only model
    name = settings.api.served_model_name or model_dir.name
    return ModelInfo(name, tokenizer, min(limit, cfg.max_position_embeddings),
                     images.image_token_id if images else None, images.tokens_per_image if images else 0,
                     read_generation_eos(model_dir, cfg.vocab_size) or cfg.eos_token_ids)


def needed_pools(settings: Settings, info: ModelInfo) -> dict[str, str]:
    """Pools this deployment cannot run at 0 replicas while the others serve (pool -> why): a vision model's
    encode pool, in disaggregated mode. ``fit_pools`` refuses such settings; the replicas file's watch, such
    a count."""
    if settings.mode == "colocated" or info.image_token_id is None:
        return {}
    return {"encode": f"the model {info.name} has a vision tower, so image requests need the encode pool"}


def fit_pools(settings: Settings, info: ModelInfo, model_dir: Path) -> tuple[Settings, dict[str, str]]:
    """The pools this model needs. Returns the settings the pools start from and, for each pool not needed,
    why (the admin API refuses to scale it with that reason; status shows it). A text-only model (no vision
    tower) runs no encode pool; asking for encode replicas for one (encode.replicas > 0 in the YAML file, an
    EPD_ENCODE__REPLICAS variable or a flag) is a ``SettingsError`` saying why, before anything starts. So is
    encode.replicas=0 for a vision model: its image requests would have nowhere to go, and /ready waits for
    every pool the model needs."""
    if settings.mode == "colocated":
        return settings, {p: f"colocated mode has no {p} pool; its decode workers run whole requests: scale decode"
                          for p in ("encode", "prefill")}
    if info.image_token_id is not None:
        e, p = settings.encode.engine.dtype, settings.prefill.engine.dtype
        if e != p:
            raise SettingsError(f"encode.engine.dtype ({e}) and prefill.engine.dtype ({p}) must match for a vision "
                                f"model: an image's embeddings move only between workers whose vision towers' "
                                f"fingerprints, over their weights as loaded, are equal")
        if settings.encode.replicas == 0:
            raise SettingsError(f"encode.replicas=0: {needed_pools(settings, info)['encode']} (and the API is not "
                                f"ready without it); set encode.replicas to 1 or more, or serve a text-only model")
        return settings, {}
    encode = settings.encode
    if "replicas" in encode.model_fields_set and encode.replicas > 0:
        raise SettingsError(f"encode.replicas={encode.replicas}: the model {model_dir} is text-only (it has no vision "
                            f"tower), so it needs no encode pool; leave encode.replicas unset or set it to 0")
    why = f"not needed: the model {info.name} is text-only (it has no vision tower), so nothing is encoded"
    return settings.model_copy(update={"encode": encode.model_copy(update={"replicas": 0})}), {"encode": why}


def pools_line(manager: PoolManager, not_needed: dict[str, str]) -> str:
    """The pools' sizes as the manager runs them now: ``encode 1, prefill 2, decode 2`` (a pool this
    deployment does not need: ``encode not needed``)."""
    from controlplane.state import Pool

    return ", ".join(f"{p.value} not needed" if p.value in not_needed else f"{p.value} {len(manager.replicas(p))}"
                     for p in Pool)


def rewrite_targets(conn: StateConnection, manager: PoolManager) -> None:
    """After a restarted private Redis: each pool's target as the manager last knew it (a scale-up under way
    is kept; before any, what it runs)."""
    from controlplane.state import Pool, PoolTargets

    targets = PoolTargets(conn)
    for pool in Pool:
        targets.set_target(pool, manager.last_target(pool))


def validate(settings: Settings, model_dir: Path) -> None:
    """What the settings cannot check alone, checked before anything starts: the codec policy against the
    model's layers and the mTLS files. Raises ``SettingsError`` naming the setting. (Device spellings,
    URLs and cross-field rules are the settings' own validators.)"""
    from controlplane.model_folder import model_folder_problem
    from kvtransfer.auth import SecurityConfigError, TransferSecurity
    from kvtransfer.policy import ExplicitPolicy, PolicyError, parse_policy
    from workers.runtime.config import ModelConfig

    problem = model_folder_problem(model_dir)
    if problem is not None:
        raise SettingsError(f"model: {problem}")
    t = settings.transfer
    policy = parse_policy(settings.wire_codec_policy())
    if isinstance(policy, ExplicitPolicy):
        layers = ModelConfig.from_file(model_dir / "config.json").num_layers
        try:
            policy.resolve(layers)
        except PolicyError as exc:
            raise SettingsError(f"transfer.codec_policy {t.codec_policy!r}: {exc}") from None
    for name, path in (("tls_ca", t.tls_ca), ("tls_cert", t.tls_cert), ("tls_key", t.tls_key)):
        if path is None:
            continue
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise SettingsError(f"transfer.{name}: cannot read {path}: {exc.strerror}") from None
    if t.tls_ca is not None:  # readable; now whether they are a CA, a certificate and its key
        try:
            TransferSecurity(token=None, tls_ca=t.tls_ca, tls_cert=t.tls_cert, tls_key=t.tls_key,
                             allow_insecure=True).ssl_context(server_side=True)
        except SecurityConfigError as exc:
            raise SettingsError(f"transfer.tls_ca/tls_cert/tls_key: {exc}") from None


@dataclass
class Deployment:
    """What ``build`` started, and how to stop it: ``closers`` run last-added first, each named by what it
    waits for (a string, or a callable that says it at that moment). ``ready_line`` names the model, the
    mode and the pools' sizes once everything is up."""

    settings: Settings
    app: Any
    closers: list[tuple[str | Callable[[], str], Callable[[], None]]] = field(default_factory=list)
    ready_line: str = ""

    def add(self, what: str | Callable[[], str], close: Callable[[], None]) -> None:
        self.closers.append((what, close))

    def replace(self, close: Callable[[], None], by: Callable[[], None]) -> None:
        self.closers = [(what, by if c == close else c) for what, c in self.closers]

    def close(self, say: Callable[[str], None] | None = None) -> None:
        """Run every closer (a failing one is logged and the rest still run). ``say`` hears what each step
        waits for before it starts, and how long the whole stop took."""
        started = time.monotonic()
        for what, close in reversed(self.closers):
            if say is not None:
                say(f"epd: stopping: {what() if callable(what) else what}")
            try:
                close()
            except Exception:  # keep closing the rest
                log.exception("shutdown step failed")
        if say is not None and self.closers:
            say(f"epd: stopped in {time.monotonic() - started:.1f} s")
        self.closers.clear()


def build(settings: Settings) -> Deployment:
    from controlplane.ray_env import loopback_environment, no_auto_connect, replica_lines_environment

    loopback_environment(settings.ray.address is not None, settings.ray.loopback_only)  # before Ray is imported
    replica_lines_environment(sys.stderr.isatty())
    no_auto_connect()
    from controlplane.admin import admin_router, drain_over_rpc, resume_over_rpc
    from controlplane.admin_client import ensure_admin_token, private_redis_url_file, write_private_file
    from controlplane.api.app import create_app
    from controlplane.dispatch import Dispatcher
    from controlplane.pools.manager import PoolManager
    from controlplane.scheduler.policies import get_policy
    from controlplane.scheduler.scheduler import Scheduler, WorkerView
    from controlplane.state import LocalRedis, RequestJournal, WorkerRegistry, connect
    from controlplane.state.client import redact
    from controlplane.state.watchdog import PrivateRedisWatchdog
    from kvtransfer.auth import TransferSecurity
    from workers.runtime.default_model import ensure_default_checkpoint

    dep = Deployment(settings, None)
    try:
        from controlplane.observability.deploy import configure_process
        from controlplane.observability.tracing import stop_exporting
        if configure_process(settings.observability, "epd-controlplane"):  # bad OTEL_* fail here, before Ray
            dep.add("the trace exporter (sending the spans it holds)", stop_exporting)  # last: the shutdown's spans too
        model_dir = settings.model or ensure_default_checkpoint()
        validate(settings, Path(model_dir))
        info = model_info(settings, Path(model_dir))
        settings, not_needed = fit_pools(settings, info, Path(model_dir))
        url = settings.redis.url
        redis = None
        if url is None:
            # with a password: another local user could otherwise read the registry, register a worker of its
            # own and receive the transfer token and prompts
            redis = LocalRedis(password=secrets.token_urlsafe(24)).start()
            url = redis.url
            log.info("started a private redis-server at %s", redact(url))
            dep.add("the private redis-server", redis.close)
            url_file = private_redis_url_file(settings.api.port)  # for redis-cli -u, and epd bench chaos
            write_private_file(url_file, url)
            dep.add(f"its URL file {url_file}", lambda: url_file.unlink(missing_ok=True))
        conn = connect(url, settings.redis.prefix)
        dep.add("the Redis connection", conn.close)
        token = settings.transfer.token.get_secret_value() if settings.transfer.token else secrets.token_urlsafe(32)
        admin_token = ensure_admin_token(settings)
        manager = PoolManager(settings, url, settings.redis.prefix, token).start()
        dep.add(lambda: f"the pools ({pools_line(manager, not_needed)}; each replica gets up to 5 s to finish the "
                        f"RPCs it is serving){', then the local Ray' if manager.runtime.owns_connection else ''}",
                manager.stop)
        from controlplane.pools.ray_probe import RayProbe
        address = manager.runtime.address
        ray_probe = RayProbe(f"the Ray cluster at {address}" if address else "the local Ray").start()  # see /health
        dep.add("the Ray probe", ray_probe.close)
        if settings.replicas_file is not None:  # a count changed in it becomes that pool's target, as epd scale
            from controlplane.replicas_file import ReplicasFileWatch
            from controlplane.state import PoolTargets
            watch = ReplicasFileWatch(settings.replicas_file, PoolTargets(conn), colocated=settings.mode == "colocated",
                                      not_needed=not_needed, needed=needed_pools(settings, info)).start()
            dep.add("the replicas file's watch", watch.close)
        if redis is not None:  # restarted on its port if it dies; still closed last, after the manager's goodbyes
            watchdog = PrivateRedisWatchdog(redis, lambda: rewrite_targets(conn, manager)).start()
            dep.replace(redis.close, watchdog.close)
        registry = WorkerRegistry(conn, ttl=settings.redis.heartbeat_ttl_s)
        t = settings.transfer
        security = TransferSecurity(token=token, tls_ca=t.tls_ca, tls_cert=t.tls_cert, tls_key=t.tls_key)
        sch = settings.scheduler
        dispatcher = Dispatcher(security, max_calls_per_worker=t.max_streams,  # the workers' stream budget
                                keepalive_s=sch.keepalive_s, token_idle_timeout_s=sch.token_idle_timeout_s,
                                first_token_timeout_s=sch.first_token_timeout_s)
        dep.add("the connections to the workers", dispatcher.close)
        manager.listen(dispatcher)  # a replica gone for good: its channel closes once its calls end
        from controlplane.state.journal import BackgroundJournal
        # journal writes stay off the request path
        journal = BackgroundJournal(RequestJournal(conn, recent_cap=settings.redis.journal_cap))
        dep.add("the request journal (writing what it still holds to Redis)", journal.close)
        # routing reads Redis with one bounded try per command; past it, its last good snapshot
        route_conn = conn.with_budget(settings.redis.command_budget_s)
        dep.add("the routing connection to Redis", route_conn.close)
        route_view = WorkerView(WorkerRegistry(route_conn, ttl=settings.redis.heartbeat_ttl_s),
                                empty_grace_s=settings.redis.heartbeat_ttl_s,
                                block_size=settings.pool("decode").engine.block_size)
        # kept fresh from its own thread: routing reads the snapshot in memory, not Redis
        dep.add("the worker view's refresher (one Redis read at most)", route_view.start().close)
        from controlplane.scheduler.health import WorkerHealth
        health = WorkerHealth(sch.breaker_failures, sch.breaker_open_s, on_lost=manager.suspect)
        scheduler = Scheduler(info, route_view, dispatcher, get_policy(settings.scheduler.routing_policy),
                              settings.scheduler, journal, colocated=settings.mode == "colocated", health=health)
        keys = [k.get_secret_value() for k in settings.api.api_keys]
        fixed = not_needed or None
        from controlplane.admin import pools_status
        from controlplane.observability.deploy import instrument_control_plane, uninstrument

        # pool gauges for /metrics and the dashboard, over this deployment's Redis
        routers = instrument_control_plane(lambda: pools_status(conn, registry, manager, fixed),
                                           lambda: scheduler.waiting, RequestJournal(conn),
                                           scheduler.room.first_waited_s)
        dep.add("the metrics' sources", uninstrument)
        dep.app = create_app(scheduler, keys, admin=admin_router(conn, registry, admin_token,
                                                                 on_drain=drain_over_rpc(registry, security),
                                                                 on_resume=resume_over_rpc(registry, security),
                                                                 fixed_pools=fixed, starts=manager),
                             routers=routers, relay_wait_s=settings.scheduler.queue_timeout_s,
                             ops_token=settings.api.ops_token.get_secret_value() if settings.api.ops_token else None,
                             unhealthy=ray_probe.lost, cors_origins=settings.api.cors_allow_origins,
                             sse_keepalive_s=settings.api.sse_keepalive_s)
        dep.ready_line = f"{info.name} ({settings.mode}: {pools_line(manager, not_needed)})"
    except BaseException:
        dep.close()
        raise
    return dep


def check_port(host: str, port: int) -> None:
    """Refuse, in one line and before anything starts, an API address this host cannot listen on (a port in
    use, a host that is not this machine's): otherwise Redis, Ray and every replica came up first, and then
    uvicorn failed. A probe bind, closed at once (uvicorn binds its own; one that loses the port meanwhile
    is refused the same way)."""
    try:
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except socket.gaierror as exc:
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror}") from None
    try:
        with socket.socket(family, socket.SOCK_STREAM) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is no obstacle
            probe.bind((host, port))
    except OSError as exc:
        hint = "; another epd serve (or another server) uses it: stop it or pick --port" \
            if exc.errno == errno.EADDRINUSE else ""
        raise UsageError(f"cannot listen on {host}:{port}: {exc.strerror or exc}{hint}") from None


OPEN_FILES_WANTED = 65536


def raise_open_files_limit(wanted: int = OPEN_FILES_WANTED) -> int:
    """Raise this process's soft limit on open files towards ``wanted`` (as far as the hard limit allows), as
    vLLM's API server does: each client connection holds one, and a container's default soft limit is often
    1,024 (its hard limit far above), where about a thousand streaming clients would make the API refuse new
    connections. Returns the soft limit now in force; a limit that cannot be raised is left as it is."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, target, exc)
            return soft
        log.info("open-files limit raised from %d to %d (the hard limit is %s)", soft, target,
                 "unlimited" if hard == resource.RLIM_INFINITY else hard)
        return target
    return soft


class SignalSeen:
    """Whether ``signum`` arrived while this watched (main thread only). Python drops the exception a signal
    handler raises inside an at-fork callback ("Exception ignored in ... _releaseLock"), and Ray starts its
    processes with such callbacks running, so a SIGTERM during start-up could be lost: the stack then came
    up and served. The signal's number still reaches the wakeup fd this sets."""

    def __init__(self, signum: int) -> None:
        self.signum = signum
        self._read, self._write = socket.socketpair()
        self._read.setblocking(False)
        self._write.setblocking(False)
        self._previous = signal.set_wakeup_fd(self._write.fileno(), warn_on_full_buffer=False)

    def close(self) -> bool:
        """Stop watching; whether the signal came meanwhile. Idempotent (False after the first)."""
        if self._read.fileno() < 0:
            return False
        signal.set_wakeup_fd(self._previous)
        seen = b""
        with contextlib.suppress(BlockingIOError):
            while chunk := self._read.recv(4096):
                seen += chunk
        self._read.close()
        self._write.close()
        return self.signum in seen


def serve(settings: Settings) -> int:
    import uvicorn

    from controlplane.api.auth import mask_tokens_in_access_log
    from controlplane.api.http_protocol import limit_repeated_warnings, server_config
    from controlplane.heap import freeze_startup_heap
    from controlplane.log_lines import log_to_stderr

    log_to_stderr("serve")  # its own messages (and each replica's, forwarded by Ray) where it runs
    check_port(settings.api.host, settings.api.port)
    raise_open_files_limit()  # each client connection holds a file

    def interrupted(*_: object) -> None:  # SIGTERM while starting: unwind as Ctrl-C does, stopping what started
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, interrupted)
    term = SignalSeen(signal.SIGTERM)
    try:
        dep = build(settings)
    finally:
        termed = term.close()
    try:  # from here on, whatever ends it (an interrupt included) stops what build started
        if termed:  # a SIGTERM during start-up whose KeyboardInterrupt Python dropped (SignalSeen)
            raise KeyboardInterrupt
        freeze_startup_heap("control plane")
        config = server_config(dep.app, keep_alive_s=settings.api.keep_alive_s, host=settings.api.host,
                               port=settings.api.port, log_level="info", timeout_graceful_shutdown=10)
        mask_tokens_in_access_log()  # the dashboard's ?token= stays out of the access log
        limit_repeated_warnings()  # a client sending garbage cannot fill the log
        server = uvicorn.Server(config)
        signal.signal(signal.SIGTERM, lambda *_: setattr(server, "should_exit", True))
        print(f"epd: serving {dep.ready_line} on http://{settings.api.host}:{settings.api.port} (Ctrl-C to stop)",
              flush=True)
        server.run()
    except SystemExit as exc:  # uvicorn's startup failure (3): the port taken after check_port, or the app's
        if exc.code == 3:
            check_port(settings.api.host, settings.api.port)  # the one-line refusal, when the port is why
        raise
    finally:
        dep.close(say=lambda line: print(line, flush=True))
    return 0
