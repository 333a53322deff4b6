"""A pool manager and a Ray probe in their own process, for the Ray-loss test:
``python ray_loss_process.py RAY_ADDRESS REDIS_URL PREFIX TOKEN SETTINGS_JSON [--auto-connect]``. After
``start()`` it prints "started"; after a line on stdin (the head is gone) it prints what ``RayProbe.lost()``
said and after how long; 10 s after the Ray client gave up reconnecting (``RAY_CLIENT_RECONNECT_GRACE_PERIOD``
after the line), the Ray processes (raylet, GCS) it started itself meanwhile, as a JSON list; then
"stopped in S" once ``PoolManager.stop()`` returned. ``--auto-connect``: without ``no_auto_connect``."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helper modules

from controlplane.ray_env import loopback_environment, no_auto_connect  # noqa: E402

loopback_environment(False, True)  # before Ray is imported: this driver's node address is 127.0.0.1
if "--auto-connect" not in sys.argv:
    no_auto_connect()  # as epd serve

from controlplane.pools import PoolManager  # noqa: E402
from controlplane.pools.ray_probe import RayProbe  # noqa: E402
from controlplane.settings import Settings  # noqa: E402

from proc_helpers import command_line, descendants  # noqa: E402


def main() -> None:
    address, redis_url, prefix, token, settings_json = sys.argv[1:6]
    manager = PoolManager(Settings.model_validate_json(settings_json), redis_url, prefix, token, address,
                          reconcile_interval_s=0.2).start()
    probe = RayProbe(f"the Ray cluster at {address}", every_s=0.5, lost_after_s=5.0).start()
    time.sleep(6)  # past the probe's limit: "started None" only if a round trip succeeded meanwhile
    print("started", probe.lost(), flush=True)
    sys.stdin.readline()
    killed = time.monotonic()
    while (reason := probe.lost()) is None and time.monotonic() - killed < 120:
        time.sleep(0.2)
    print(f"lost after {time.monotonic() - killed:.1f} s: {reason}", flush=True)
    # the Ray client gives up after its reconnect grace (30 s unless set); the reconcile loop keeps calling Ray
    grace = float(os.environ.get("RAY_CLIENT_RECONNECT_GRACE_PERIOD", "30"))
    time.sleep(max(0.0, killed + grace + 10 - time.monotonic()))
    ray_processes = [cmd[:120] for cmd in map(command_line, sorted(descendants(os.getpid())))
                     if "raylet" in cmd or "gcs_server" in cmd]  # a local Ray this process started
    print(json.dumps(ray_processes), flush=True)
    probe.close()
    began = time.monotonic()
    manager.stop()
    print(f"stopped in {time.monotonic() - began:.1f} s", flush=True)


if __name__ == "__main__":
    main()
