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

from controlplane.ray_env import loopback_environment, no_auto_connect

loopback_environment(False, True)  # before Ray is imported: this driver's node address is 127.0.0.1
if "--auto-connect" not in sys.argv:
    no_auto_connect()  # as epd serve

from controlplane.pools import PoolManager  # noqa: E402
from controlplane.pools.ray_probe import RayProbe  # noqa: E402
from controlplane.settings import Settings  # noqa: E402


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
    print(json.dumps(_ray_processes_below(os.getpid())), flush=True)
    probe.close()
    began = time.monotonic()
    manager.stop()
    print(f"stopped in {time.monotonic() - began:.1f} s", flush=True)


def _ray_processes_below(pid: int) -> list[str]:
    """The raylet and GCS processes among ``pid``'s descendants: a local Ray this process started."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            children.setdefault(ppid, []).append(int(entry.name))
    found, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        todo.extend(children.get(p, []))
        try:
            cmd = (Path("/proc") / str(p) / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if "raylet" in cmd or "gcs_server" in cmd:
            found.append(cmd[:120])
    return found


if __name__ == "__main__":
    main()
