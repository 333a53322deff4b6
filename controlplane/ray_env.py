"""Ray's environment, set before Ray is imported (this module never imports it).

Ray fixes its node address when it is imported: with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (its
single-host mode) a local cluster takes 127.0.0.1, and its GCS, raylet, agents and worker processes bind
there; without it they bind every interface. ``epd serve`` calls ``loopback_environment`` first thing.

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


def loopback_environment(joins_cluster: bool, loopback_only: bool) -> bool:
    """Ask the local Ray this process may start to bind loopback only. Call before ``import ray``. A cluster
    address, ``loopback_only`` False, or the variable already set (the user's choice): left alone. Returns
    whether it was set here."""
    if joins_cluster or not loopback_only or LOOPBACK_VAR in os.environ:
        return False
    os.environ[LOOPBACK_VAR] = "0"
    return True


def reserved_cuda_device(device: str, gpu_ids: Sequence[str | int], visible: str | None) -> str:
    """The torch device, in this process's view of the node's GPUs, of ``device`` ("cuda" or "cuda:k": the
    k-th GPU Ray reserved). ``gpu_ids`` is ``ray.get_gpu_ids()``: entries of the node's
    ``CUDA_VISIBLE_DEVICES`` (indexes or UUIDs) when the raylet started with it, else indexes;
    ``visible`` is this process's ``CUDA_VISIBLE_DEVICES`` (None: unset, every GPU in CUDA's order).
    ``ValueError`` naming the mismatch when Ray reserved fewer GPUs than ``device`` needs, or one that
    ``visible`` does not list."""
    ids = sorted((str(i).strip() for i in gpu_ids), key=lambda i: (not i.isdigit(), int(i) if i.isdigit() else 0, i))
    k = int(device.partition(":")[2] or 0)
    if k >= len(ids):
        raise ValueError(f"engine.device {device} needs {k + 1} GPU(s) but Ray reserved {len(ids)} for this replica "
                         f"({ids}): set the pool's num_gpus")
    chosen = ids[k]
    if visible is None:
        if not chosen.isdigit():
            raise ValueError(f"Ray reserved GPU {chosen!r}, which is not an index, and CUDA_VISIBLE_DEVICES is unset")
        return f"cuda:{int(chosen)}"
    order = [v.strip() for v in visible.split(",") if v.strip()]
    if chosen not in order:
        raise ValueError(f"Ray reserved GPU {chosen!r}, which this process's CUDA_VISIBLE_DEVICES={visible!r} "
                         "does not list")
    return f"cuda:{order.index(chosen)}"
