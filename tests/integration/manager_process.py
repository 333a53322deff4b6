"""A pool manager in its own process, for the adoption tests (they SIGKILL it, as an OOM kill would):
``python manager_process.py RAY_ADDRESS REDIS_URL PREFIX TOKEN SETTINGS_JSON [START_TIMEOUT_S]``. After
``start()`` it prints one JSON line, pool -> [[worker_id, actor pid], ...], then stops cleanly when a line
arrives on stdin; a start that fails (``WorkerStartError``) prints {"failed": its message} and exits 0.
``MANAGER_PROCESS_WIRE_DIGEST`` set: this manager takes its wire protocol for that one (as a control plane on another
image than its Ray nodes would), its replicas keep their own."""

from __future__ import annotations

import json
import os
import sys

from controlplane.ray_env import loopback_environment

loopback_environment(False, True)  # before Ray is imported: this driver's node address is 127.0.0.1

import ray  # noqa: E402

from controlplane.pools import PoolManager, WorkerStartError  # noqa: E402
from controlplane.settings import Settings  # noqa: E402
from controlplane.state import Pool  # noqa: E402


def main() -> None:
    address, redis_url, prefix, token, settings_json = sys.argv[1:6]
    start_timeout_s = float(sys.argv[6]) if len(sys.argv) > 6 else None
    if "MANAGER_PROCESS_WIRE_DIGEST" in os.environ:
        import controlplane.pools.manager as manager_module
        digest = os.environ["MANAGER_PROCESS_WIRE_DIGEST"]
        manager_module.wire_digest = lambda: digest  # type: ignore[assignment]  # this process's side only
    manager = PoolManager(Settings.model_validate_json(settings_json), redis_url, prefix, token, address,
                          reconcile_interval_s=0.2, start_timeout_s=start_timeout_s)
    try:
        manager.start()
    except WorkerStartError as exc:
        print(json.dumps({"failed": str(exc)}), flush=True)
        return
    held = {p.value: [[r.worker_id, ray.get(r.actor.pid.remote(), timeout=30)] for r in manager.replicas(p)]
            for p in Pool}
    print(json.dumps(held), flush=True)
    sys.stdin.readline()
    manager.stop()
    print("stopped", flush=True)


if __name__ == "__main__":
    main()
