"""The Ray the pools run on: join a cluster at an address, reuse the driver's, or start a private one.

Lifecycle:
  1. ``start()``   with an address: ``ray.init(address=...)``, credentials as the user configured them
                   (``RAY_AUTH_MODE``/``RAY_AUTH_TOKEN``); a cluster that cannot be reached or refuses
                   the token is a ``RayJoinError`` naming the address and this process's Ray auth mode.
                   Ray already initialised in this process: reused, never shut down here.
                   Otherwise a local cluster that is ours alone: its own temp dir (Ray writes under the
                   system temp dir unless told otherwise), all of the machine's CPUs (replicas reserve
                   fractions), no dashboard, a small object store (only control messages use it).
                   Either way the replicas' output (their log lines: ``log_lines.log_to_stderr``) is
                   forwarded to this process's (Ray's ``log_to_driver``; how it prints them:
                   ``ray_env.replica_lines_environment``); Ray also keeps it in its worker log files. Token
                   auth stays on,
                   with a fresh token in a 0600 file in that temp dir: Ray 2.60 would otherwise write
                   ``~/.ray/auth_token`` on first start, which then switches every later local
                   ``ray.init`` of the user to token auth. A user who set ``RAY_AUTH_MODE`` (or a
                   token) gets exactly that. Ray's processes start without the control plane's secrets in
                   their environment (``settings.secret_env_vars``). Ray makes the folder it is given, and
                   every folder it makes in it (session, logs, sockets), mode 0777 without the sticky bit: any
                   local user could then swap its token file, its sockets, or a log it rewrites by path (a
                   symlink: the stack then overwrites a file of the user's choosing). So Ray gets a folder
                   inside this process's own 0700 one, which no other user can enter. With ``loopback_only``
                   every process of that cluster (GCS, raylet, agents, workers) binds 127.0.0.1: Ray takes its
                   node address from its local-only switch ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read when
                   Ray is imported, so ``loopback_environment()`` must run before the process's first
                   ``import ray`` (``epd serve`` does). ``start()`` warns when the node address is not loopback.
  2. ``stop()``    ``ray.shutdown()`` if ``start`` called ``ray.init``; then the environment is restored
                   and the temp dir removed. Idempotent.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import tempfile
import time
from pathlib import Path

import ray

from controlplane.pools.status import RayJoinError
from controlplane.ray_env import LOOPBACK_HOSTS, LOOPBACK_VAR, loopback_environment
from controlplane.settings import secret_env_vars

log = logging.getLogger(__name__)

OBJECT_STORE_BYTES = 128 * 2**20
RAY_SUBDIR = "r"  # Ray's folder inside the private 0700 one (short: its socket paths must stay under 108 bytes)
JOIN_TRIES = 3  # joins at an address refused by the Ray client proxy's failed server start
JOIN_PAUSE_S = 1.0
_AUTH_VARS = ("RAY_AUTH_MODE", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def _reload_ray_auth() -> None:
    """Make this process's Ray core see the current RAY_AUTH_* variables. Ray caches its config and
    token at import; its own ``_enable_token_auth`` refreshes them this way (config before token)."""
    from ray._raylet import AuthenticationTokenLoader, Config  # type: ignore[attr-defined]  # ray's _raylet.pyi omits them

    Config.initialize("")
    AuthenticationTokenLoader.instance().reset_cache()


def _reason(exc: BaseException) -> str:
    """``exc`` in one line; of a server's traceback (several lines) its first and last."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()] or [type(exc).__name__]
    return lines[0] if len(lines) == 1 else f"{lines[0]} {lines[-1]}"


def join_failure(address: str, exc: BaseException) -> str:
    """Why joining the cluster at ``address`` failed, with what to check. A token-auth cluster answers a
    Ray client without its token with a timeout, not a refusal, so the auth mode is always named."""
    mode = os.environ.get("RAY_AUTH_MODE") or "disabled"
    has_token = bool(os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH"))
    here = f"RAY_AUTH_MODE={mode}" + (", with a token" if has_token else ", no RAY_AUTH_TOKEN")
    if isinstance(exc, ConnectionAbortedError):  # the client port answered; the head's proxy failed this client
        return (f"cannot join the Ray cluster at {address}: {_reason(exc)}. The head's Ray client proxy could not "
                f"start a server for this client: see ray_client_server*.err in the head's Ray log folder "
                f"(/tmp/ray/session_latest/logs). Here: {here}")
    port = "client port" if address.startswith("ray://") else "GCS port"
    return (f"cannot join the Ray cluster at {address}: {_reason(exc)}. Check that its {port} is reachable from "
            f"here and, if the cluster runs Ray token auth (the chart's default), that this process has its "
            f"token: RAY_AUTH_MODE=token and RAY_AUTH_TOKEN (or RAY_AUTH_TOKEN_PATH). Here: {here}")


class RayRuntime:
    def __init__(self, address: str | None, namespace: str, num_cpus: int | None = None,
                 loopback_only: bool = True, num_gpus: int | None = None) -> None:
        """``num_cpus``/``num_gpus``: what a private cluster declares (default: every CPU; the GPUs Ray finds)."""
        self.address = address
        self.loopback_only = loopback_only
        self.namespace = namespace
        self.num_cpus = num_cpus or os.cpu_count() or 1
        self.num_gpus = num_gpus
        self.temp_dir: Path | None = None  # the private cluster's, while it runs
        self.owns_connection = False
        self._saved_env: dict[str, str | None] | None = None

    def start(self) -> None:
        if ray.is_initialized():
            return
        if self.address is not None:
            self._join(self.address)
            self.owns_connection = True
            return
        self.temp_dir = Path(tempfile.mkdtemp(prefix="epd-ray-"))
        try:
            self._private_token()
            if loopback_environment(False, self.loopback_only):  # Ray's child processes read it too
                self._saved_env = {**(self._saved_env or {}), LOOPBACK_VAR: None}
            # Ray's processes, and the replicas they start, inherit this environment: not the control plane's secrets
            hidden = {name: os.environ.pop(name) for name in secret_env_vars(list(os.environ))}
            try:
                ray.init(num_cpus=self.num_cpus, num_gpus=self.num_gpus, namespace=self.namespace,
                         include_dashboard=False, _temp_dir=str(self.temp_dir / RAY_SUBDIR), log_to_driver=True,
                         logging_level=logging.WARNING, object_store_memory=OBJECT_STORE_BYTES)
            finally:
                os.environ.update(hidden)
        except BaseException:
            self._restore()
            raise
        self.owns_connection = True
        node_ip = ray.util.get_node_ip_address()
        if self.loopback_only and node_ip not in LOOPBACK_HOSTS:
            log.warning("the local Ray took the node address %s and listens beyond loopback: Ray was imported "
                        "before %s=0 was set (set it in the environment first)", node_ip, LOOPBACK_VAR)

    def _join(self, address: str) -> None:
        """``ray.init`` at ``address``. The head's Ray client proxy starts a server process per client, and that
        start sometimes fails (the client then sees "Initialization failure from server"): such a refusal is
        tried again after JOIN_PAUSE_S, up to JOIN_TRIES in all. A connection failure (unreachable, a token
        refused or missing), or the last refusal, is a ``RayJoinError``; anything else Ray raises (a version
        mismatch, say) is left as it is."""
        for attempt in range(1, JOIN_TRIES + 1):
            try:
                ray.init(address=address, namespace=self.namespace, log_to_driver=True,
                         logging_level=logging.WARNING)
                return
            except ConnectionAbortedError as exc:
                if attempt == JOIN_TRIES:
                    raise RayJoinError(join_failure(address, exc)) from exc
                log.warning("joining the Ray cluster at %s (try %d of %d): %s; trying again", address, attempt,
                            JOIN_TRIES, _reason(exc))
                ray.shutdown()
                time.sleep(JOIN_PAUSE_S)
            except (ConnectionError, ray.exceptions.AuthenticationError) as exc:
                raise RayJoinError(join_failure(address, exc)) from exc

    def _private_token(self) -> None:
        if any(v in os.environ for v in _AUTH_VARS):
            return  # the user chose; respect it
        assert self.temp_dir is not None
        path = self.temp_dir / "auth_token"
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32))
        self._saved_env = {**(self._saved_env or {}), **{v: os.environ.get(v) for v in _AUTH_VARS}}
        os.environ["RAY_AUTH_MODE"] = "token"
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(path)  # Ray's own processes inherit both
        _reload_ray_auth()

    def stop(self) -> None:
        if self.owns_connection:
            self.owns_connection = False
            ray.shutdown()
        self._restore()

    def _restore(self) -> None:
        if self._saved_env is not None:
            for var, value in self._saved_env.items():
                if value is None:
                    os.environ.pop(var, None)
                else:
                    os.environ[var] = value
            self._saved_env = None
            _reload_ray_auth()  # before the token file goes, so nothing reloads a missing file
        if self.temp_dir is not None:
            shutil.rmtree(self.temp_dir, ignore_errors=True)
            self.temp_dir = None
