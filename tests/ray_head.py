"""A Ray cluster started as a KubeRay head is: `ray start --head --block` in its own process group, with a Ray
client port, in a short temp folder (Ray's socket paths must fit 107 bytes), killed whole on exit."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from http_helpers import free_loopback_port

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class RayHead:
    gcs: str  # 127.0.0.1:PORT, for ray.init(address=...)
    client: str  # ray://127.0.0.1:PORT
    env: dict[str, str]  # what the head ran with, minus ``head_env``: for the processes that join it
    folder: Path  # the head's log is head.log; Ray's own logs are under ray/session_latest/logs
    proc: subprocess.Popen[bytes]

    def kill(self) -> None:
        """SIGKILL the head's process group: its GCS, raylet, agents and every actor process on it."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(30)


def listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=1).close()
    except OSError:
        return False
    return True


@contextmanager
def ray_head(prefix: str, head_env: dict[str, str] | None = None, num_cpus: int = 2) -> Iterator[RayHead]:
    """``head_env``: more variables for the head alone (its Ray auth, say). The environment given to joiners
    has no RAY_AUTH_*, RAY_ADDRESS or RAY_ENABLE_AUTO_CONNECT of the test process, a private HOME, and the
    repository on PYTHONPATH."""
    folder = Path(tempfile.mkdtemp(prefix=prefix))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_AUTH", "RAY_ADDRESS", "RAY_ENABLE_AUTO"))}
    env.update(HOME=str(folder), RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER="0", PYTHONPATH=str(ROOT))
    port, client = free_loopback_port(), free_loopback_port()
    with open(folder / "head.log", "w") as log:  # the child keeps its own copy of the file
        proc = subprocess.Popen(
            [str(Path(sys.executable).with_name("ray")), "start", "--head", "--block", f"--port={port}",
             "--node-ip-address=127.0.0.1", f"--temp-dir={folder / 'ray'}", f"--num-cpus={num_cpus}",
             "--include-dashboard=false", "--disable-usage-stats", f"--ray-client-server-port={client}"],
            env={**env, **(head_env or {})}, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    head = RayHead(f"127.0.0.1:{port}", f"ray://127.0.0.1:{client}", env, folder, proc)
    try:
        deadline = time.monotonic() + 60
        while not (listening(port) and listening(client)):
            assert proc.poll() is None, "ray start failed:\n" + (folder / "head.log").read_text()[-3000:]
            assert time.monotonic() < deadline, "the Ray head did not listen within 60 s"
            time.sleep(0.2)
        yield head
    finally:
        head.kill()
        shutil.rmtree(folder, ignore_errors=True)
