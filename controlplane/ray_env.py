"""Ray's environment, set before Ray is imported (this module never imports it).

Ray fixes its node address when it is imported: with ``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0`` (its
single-host mode) a local cluster takes 127.0.0.1, and its GCS, raylet, agents and worker processes bind
there; without it they bind every interface. ``epd serve`` calls ``loopback_environment`` first thing.
"""

from __future__ import annotations

import os

LOOPBACK_VAR = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_HOSTS = ("127.0.0.1", "::1", "localhost")


def loopback_environment(joins_cluster: bool, loopback_only: bool) -> bool:
    """Ask the local Ray this process may start to bind loopback only. Call before ``import ray``. A cluster
    address, ``loopback_only`` False, or the variable already set (the user's choice): left alone. Returns
    whether it was set here."""
    if joins_cluster or not loopback_only or LOOPBACK_VAR in os.environ:
        return False
    os.environ[LOOPBACK_VAR] = "0"
    return True
