"""Connecting to Redis, and running a private ``redis-server`` when no Redis is configured.

``connect(url, prefix)`` gives a ``StateConnection``: a redis-py client with short timeouts and
exponential-backoff retries on connection errors and timeouts, the ``KeySpace`` of the prefix, and
``guard()``, which turns a connection failure that outlasted the retries into ``StateUnavailable``.
The client reconnects on its own once Redis is back; nothing has to be rebuilt.

Retries resend a command whose reply was lost, so a counter increment or journal entry can, rarely, be
applied twice. Leases and targets are idempotent writes.

``LocalRedis`` starts ``redis-server`` bound to 127.0.0.1 on a free port, without persistence, in a
temporary folder, and stops that one process (SIGTERM, then SIGKILL) on ``close()``.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import redis
from redis import exceptions as redis_errors
from redis.backoff import ExponentialWithJitterBackoff, NoBackoff
from redis.retry import Retry

from controlplane.state.errors import RedisServerNotFound, StateRefused, StateUnavailable
from controlplane.state.keys import DEFAULT_PREFIX, KeySpace

_UNREACHABLE = (redis_errors.ConnectionError, redis_errors.TimeoutError)
INSTALL_HINT = ("install it with `apt-get install -y redis-server` (Debian/Ubuntu) or `brew install redis` "
                "(macOS), or point epd at an existing Redis with --redis-url")


def redact(url: str) -> str:
    """``url`` with any password replaced by ``***``, for messages and logs: everything from the first ':'
    after ``scheme://`` to the last '@', and a ``password=`` query parameter (redis-py reads one). Not the
    parser's idea of the password: one holding '/', '?' or '#' ends the URL's authority early, and with an
    '@' as well the parser finds a fake one. An '@' in the query of a URL without a password masks part of
    it too: garbling beats leaking. Raises ValueError for what urlsplit cannot read."""
    scheme, sep, rest = url.partition("://")
    colon, at = rest.find(":"), rest.rfind("@")
    if sep and 0 <= colon < at:
        masked = f"{scheme}://{rest[:colon]}:***@{rest[at + 1:]}"
    else:
        parts = urlsplit(url)
        masked = url
        if parts.password is not None:
            netloc = parts.netloc.rsplit("@", 1)[1]
            masked = urlunsplit(parts._replace(netloc=f"{parts.username or ''}:***@{netloc}"))
    base, qmark, query = masked.partition("?")
    pairs = parse_qsl(query, keep_blank_values=True)
    if any(k.lower() == "password" for k, _ in pairs):
        masked = base + qmark + urlencode([(k, "***" if k.lower() == "password" else v) for k, v in pairs], safe="*")
    return masked


@dataclass(frozen=True)
class StateConnection:
    """A Redis client, the key space it writes under, and the (redacted) URL it came from."""

    redis: redis.Redis
    keys: KeySpace
    url: str

    @contextlib.contextmanager
    def guard(self) -> Iterator[None]:
        """Raise ``StateUnavailable`` (chaining the redis-py error) for a connection lost past retries, and
        ``StateRefused`` (a kind of it) for a Redis that refuses writes (out of memory, a read-only replica)."""
        try:
            yield
        except _UNREACHABLE as exc:
            raise StateUnavailable(self.url, str(exc) or type(exc).__name__) from exc
        except redis_errors.OutOfMemoryError as exc:
            raise StateRefused(self.url, f"{exc} (raise its maxmemory, or free memory there)") from exc
        except redis_errors.ReadOnlyError as exc:
            raise StateRefused(self.url, f"{exc} (point epd at the primary)") from exc

    def ping(self) -> None:
        """Round-trip to Redis; ``StateUnavailable`` if it cannot be reached."""
        with self.guard():
            self.redis.ping()

    def close(self) -> None:
        """Close the client's connections. Idempotent."""
        self.redis.close()

    def with_budget(self, budget_s: float) -> StateConnection:
        """A second client to the same Redis for the request path: each command gets one try of at most
        ``budget_s`` seconds (connecting included), so a stalled or restarting Redis costs a caller that
        long, not the retries' seconds. Close it on its own."""
        pool = self.redis.connection_pool
        kwargs = {**pool.connection_kwargs, "socket_timeout": budget_s, "socket_connect_timeout": budget_s,
                  "retry": Retry(NoBackoff(), 0), "health_check_interval": 0}
        client = redis.Redis(connection_pool=redis.ConnectionPool(connection_class=pool.connection_class, **kwargs))
        return StateConnection(redis=client, keys=self.keys, url=self.url)


def connect(url: str, prefix: str = DEFAULT_PREFIX, *, socket_timeout: float = 2.0,
            connect_timeout: float = 1.0, retries: int = 3, backoff_base: float = 0.05,
            backoff_cap: float = 1.0, verify: bool = True) -> StateConnection:
    """Client for the Redis at ``url`` (``redis://``, ``rediss://`` or ``unix://``), keys under ``prefix``.

    Timeouts and backoff are seconds. A command that fails with a connection error or timeout is retried
    ``retries`` times, waiting about ``backoff_base * 2**n`` (jittered, at most ``backoff_cap``) between
    tries. With ``verify`` the server is pinged now, so a wrong URL fails here with ``StateUnavailable``.
    """
    keys = KeySpace(prefix)
    retry = Retry(ExponentialWithJitterBackoff(cap=backoff_cap, base=backoff_base), retries,
                  supported_errors=_UNREACHABLE)
    client = redis.Redis.from_url(url, decode_responses=True, socket_timeout=socket_timeout,
                                  socket_connect_timeout=connect_timeout, retry=retry,
                                  health_check_interval=30)
    conn = StateConnection(redis=client, keys=keys, url=redact(url))
    if verify:
        try:
            conn.ping()
        except StateUnavailable:
            conn.close()
            raise
    return conn


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """In the child before exec (Linux): SIGTERM when the process that started us dies, so a private
    redis-server never outlives an `epd serve` that was SIGKILLed."""
    try:
        import ctypes
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except OSError:  # not Linux: the atexit finalizer still covers normal exits
        pass


def _stop(proc: subprocess.Popen[bytes], folder: str, grace: float) -> None:
    """SIGTERM the one process, SIGKILL it after ``grace`` seconds, then remove its folder."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=grace)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.kill(proc.pid, signal.SIGKILL)
            proc.wait()
    shutil.rmtree(folder, ignore_errors=True)


class LocalRedis:
    """A private, throwaway ``redis-server`` on 127.0.0.1 (no RDB, no AOF). Use as a context manager.

    ``port=None`` picks a free port; a given port lets a test restart a server where the last one was.
    ``password``: the server requires it (``requirepass``), so another local user cannot read or write the
    registry through the open loopback port; it reaches the server on its stdin, not its command line, and
    is part of ``url``. Also stopped at interpreter exit if ``close()`` was never called.
    """

    def __init__(self, *, port: int | None = None, executable: str = "redis-server",
                 startup_timeout: float = 10.0, stop_grace: float = 5.0, password: str | None = None) -> None:
        if password is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", password):  # as it stands in the URL
            raise ValueError("a LocalRedis password must be non-empty letters, digits, '_' and '-' only")
        binary = shutil.which(executable)
        if binary is None:
            raise RedisServerNotFound(f"{executable} is not installed (not found on PATH); {INSTALL_HINT}")
        self._binary = binary
        self._requested_port = port
        self._startup_timeout = startup_timeout
        self._stop_grace = stop_grace
        self.password = password
        self._proc: subprocess.Popen[bytes] | None = None
        self._finalizer: weakref.finalize | None = None
        self.port = 0

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:PORT`` of the running server (``redis://default:PASSWORD@...`` with a password:
        the user named, as ``redis-cli -u`` needs; with none it sends AUTH with an empty user name)."""
        if self._proc is None:
            raise RuntimeError("LocalRedis is not started")
        auth = f"default:{self.password}@" if self.password else ""
        return f"redis://{auth}127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RuntimeError("LocalRedis is not started")
        return self._proc.pid

    @property
    def running(self) -> bool:
        """Whether the server process is alive."""
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> LocalRedis:
        """Start the server and wait until it answers PING. A picked port that was taken is retried.

        Idempotent while running; a closed ``LocalRedis`` cannot be restarted (make a new one).
        """
        if self._finalizer is not None and not self._finalizer.alive:
            raise RuntimeError("this LocalRedis was closed; start a new one (port= reuses its port)")
        if self._proc is not None:
            return self
        attempts = 1 if self._requested_port is not None else 3
        for attempt in range(attempts):
            try:
                self._start_once(self._requested_port or _free_port())
                return self
            except RuntimeError:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def _start_once(self, port: int) -> None:
        folder = tempfile.mkdtemp(prefix="epd-redis-")
        log = Path(folder) / "redis.log"
        args = [self._binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                "--dir", folder, "--logfile", str(log), "--daemonize", "no", "--protected-mode", "yes"]
        if self.password:
            args.insert(1, "-")  # read configuration from stdin too: the password stays off the command line
        # A new session keeps a terminal's Ctrl-C away from the server: epd stops it, in order.
        proc = subprocess.Popen(args, stdin=subprocess.PIPE if self.password else subprocess.DEVNULL,
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
                                preexec_fn=_die_with_parent)
        if proc.stdin is not None:
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.write(f"requirepass {self.password}\n".encode())
            with contextlib.suppress(BrokenPipeError):
                proc.stdin.close()
        deadline = time.monotonic() + self._startup_timeout
        probe = redis.Redis(host="127.0.0.1", port=port, password=self.password, socket_timeout=0.5,
                            socket_connect_timeout=0.5, retry=Retry(ExponentialWithJitterBackoff(), 0))
        try:
            while True:
                if proc.poll() is not None:
                    tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                    raise RuntimeError(f"redis-server exited with {proc.returncode} on port {port}:\n{tail}")
                try:
                    if probe.ping():
                        break
                except _UNREACHABLE:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server on port {port} did not answer PING "
                                       f"within {self._startup_timeout} s")
                time.sleep(0.02)
        except BaseException:
            _stop(proc, folder, self._stop_grace)
            raise
        finally:
            probe.close()
        self._proc, self.port = proc, port
        self._finalizer = weakref.finalize(self, _stop, proc, folder, self._stop_grace)

    def close(self) -> None:
        """Stop the server (SIGTERM, SIGKILL after the grace period) and remove its folder. Idempotent."""
        if self._finalizer is not None:
            self._finalizer()

    def __enter__(self) -> LocalRedis:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.close()
