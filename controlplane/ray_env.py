"""Ray's environment, set before Ray is imported (this module never imports it).

Ray fixes its node address when it is imported: with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (its
single-host mode) a local cluster takes 127.0.0.1, and its GCS, raylet, agents and worker processes bind
there; without it they bind every interface. ``epd serve`` calls ``loopback_environment`` first thing.

Ray also starts a local cluster on any call made while it is not connected (``ray.get``, ``ray.kill``, an
actor call). In the control plane such a call only comes after the connection was lost (a restarted head, a
Ray client that gave up), and a local cluster inside its pod would silently stand in for the real one:
``no_auto_connect`` turns that off (read at import too).

GPUs: Ray narrows each actor's ``CUDA_VISIBLE_DEVICES`` to the GPUs it reserved, so two replicas on
different GPUs cannot open each other's CUDA IPC handles. A replica started with ``NOSET_CUDA_VAR`` set
(``PoolSettings.process_env``) keeps its node's view of every GPU, and ``reserved_cuda_device`` maps its
engine device onto the GPUs Ray reserved for it, in that view (vLLM's Ray workers do the same).
"""

from __future__ import annotations

import os
from collections.abc import Sequence

LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")
NOSET_CUDA_VAR = "RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"
AUTO_CONNECT_VAR = "RAY_ENABLE_AUTO_CONNECT"


def no_auto_connect() -> None:
    """A Ray call made while Ray is not connected raises instead of starting a local cluster. Call before
    ``import ray``; a value the user set is left alone."""
    os.environ.setdefault(AUTO_CONNECT_VAR, "0")


def replica_lines_environment(stderr_is_terminal: bool) -> None:
    """How this process prints the replicas' lines Ray forwards to it. Call before ``import ray`` (Ray reads
    the switches then); a value the user set is left alone. Every line is printed as it comes: Ray would
    otherwise hold back, and print once as "[repeated Nx]", lines of several processes that differ only in
    numbers, which is what one pool's replicas say ("prefill replica 1 serving at ..."). And no colour codes
    around the "(WorkerActor pid=N)" prefix unless stderr is a terminal."""
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    if not stderr_is_terminal:
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")


def loopback_environment(joins_cluster: bool, loopback_only: bool) -> bool:
    """Ask the local Ray this process may start to bind loopback only. Call before ``import ray``. A cluster
    address, ``loopback_only`` False, or the variable already set (the user's choice): left alone. Returns
    whether it was set here."""
    if joins_cluster or not loopback_only or LOOPBACK_VAR in os.environ:
        return False
    os.environ[LOOPBACK_VAR] = "0"
    return True


def reserved_cuda_device(device: str, gpu_ids: Sequence[str | int], visible: str | None, reserved: int) -> str:
    """The torch device, in this process's view of the node's GPUs, of ``device`` ("cuda" or "cuda:k": the
    k-th of the ``reserved`` GPUs Ray reserved, in the node's order). ``gpu_ids`` is ``ray.get_gpu_ids()``:
    entries of the node's ``CUDA_VISIBLE_DEVICES`` (indexes or UUIDs) when the raylet started with it, else
    indexes; ``visible`` is this process's ``CUDA_VISIBLE_DEVICES`` (None: unset, every GPU in CUDA's order).
    ``ValueError`` naming the mismatch when Ray reports another number of GPUs than the replica reserved
    (Ray reports every listed GPU when the node declared more than it lists), fewer than ``device`` needs,
    or one that ``visible`` does not list."""
    ids = [str(i).strip() for i in gpu_ids]
    if len(ids) != reserved:
        raise ValueError(f"Ray reports GPUs {sorted(ids)} for this replica, which reserved {reserved}: the node "
                         "declares more GPUs than its CUDA_VISIBLE_DEVICES lists; fix the node's --num-gpus, or set "
                         "the pool's gpu_visibility: reserved")
    k = int(device.partition(":")[2] or 0)
    if k >= len(ids):
        raise ValueError(f"engine.device {device} needs {k + 1} GPU(s) but Ray reserved {len(ids)} for this replica "
                         f"({sorted(ids)}): set the pool's num_gpus")
    if visible is None:
        bad = [i for i in ids if not i.isdigit()]
        if bad:
            raise ValueError(f"Ray reserved GPU {bad[0]!r}, which is not an index, and CUDA_VISIBLE_DEVICES is unset")
        return f"cuda:{sorted(int(i) for i in ids)[k]}"
    order = [v.strip() for v in visible.split(",") if v.strip()]
    missing = [i for i in ids if i not in order]
    if missing:
        raise ValueError(f"Ray reserved GPU {missing[0]!r}, which this process's CUDA_VISIBLE_DEVICES={visible!r} "
                         "does not list")
    return f"cuda:{sorted(order.index(i) for i in ids)[k]}"
