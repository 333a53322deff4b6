"""What a pool manager starts a replica with (its settings, placement and launch key), and why a start failed,
in words an operator can act on."""

from __future__ import annotations

import hashlib
import re
import shutil
from pathlib import Path
from typing import Any

import ray

from controlplane.pools.replica import WireMismatch
from controlplane.settings import PoolSettings, Settings

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Left out of the settings each replica gets: secrets never ride in Ray task args, and the replicas file is the
# control plane's (its counts are applied already; the file is not mounted where replicas run).
NOT_FOR_REPLICAS: dict[str, Any] = {"transfer": {"token"}, "api": {"admin_token", "api_keys", "ops_token"},
                                    "replicas_file": True}


def launch_key(pool: str, model_dir: str, settings_json: str, token: str, redis_url: str, redis_prefix: str) -> str:
    """What a replica was started with, as one digest (the token and URL never appear in it): a pool manager
    adopts a running replica only when its own key for that pool is the same (``PoolManager._adopt``).
    ``settings_json`` leaves out the replica counts, which change while a deployment serves."""
    h = hashlib.sha256()
    for part in (pool, model_dir, settings_json, token, redis_url, redis_prefix):
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def replica_settings_json(settings: Settings) -> str:
    """The settings a replica is started with (``WorkerActor`` validates them again, on its own node): these,
    without the secrets and without ``replicas_file``."""
    return settings.model_dump_json(exclude=NOT_FOR_REPLICAS)


def placement_options(ps: PoolSettings) -> dict[str, Any]:
    """The Ray actor options that place one replica of a pool: its reservations and its process's environment."""
    env = ps.process_env()
    return {"num_cpus": ps.num_cpus, "num_gpus": ps.num_gpus, "resources": dict(ps.ray_resources) or None,
            "runtime_env": {"env_vars": env} if env else None}


LOW_DISK_BYTES = 64 * 2**20


def disk_hint(temp_dir: Path | None) -> str:
    """A note when the private Ray cluster's folder (logs, sockets, spilled objects) is on a nearly full disk:
    new actors then die at start with nothing of their own to say why (Ray cannot write their logs)."""
    if temp_dir is None:
        return ""
    try:
        usage = shutil.disk_usage(temp_dir)
    except OSError:
        return ""
    if usage.free >= LOW_DISK_BYTES:
        return ""
    return (f" (the disk under Ray's folder {temp_dir} has {usage.free / 2**20:.0f} MiB free of "
            f"{usage.total / 2**20:.0f} MiB: a full disk stops new replicas; free space there, or set TMPDIR)")


def describe_start_failure(exc: BaseException, num_cpus: float, num_gpus: float, timeout_s: float) -> str:
    if isinstance(exc, ray.exceptions.GetTimeoutError):
        return (f"did not start within {timeout_s:.0f} s (the cluster may lack {num_cpus} CPU / {num_gpus} GPU "
                "free for it)")
    if isinstance(exc, WireMismatch):
        return str(exc)
    if isinstance(exc, ray.exceptions.RayActorError):
        text = _ANSI.sub("", str(exc)).strip()
        if exc.actor_init_failed:  # Ray's text ends with the constructor's "Type: message"; lead with it
            last = text.splitlines()[-1]
            if "unexpected keyword argument 'wire'" in last:  # code older than the wire check
                last += (" (its Ray node runs an older epd image than the control plane; replace those pods so "
                         "every node runs the control plane's image)")
            return f"{last}\n  (raised while the actor started; Ray's report follows)\n{text}"
        return f"the actor died while starting: {text}"
    return f"{type(exc).__name__}: {exc}"
