"""Run `epd serve` as a user does: a real subprocess (Redis, Ray, pools, HTTP API) in its own session.

``serve_process(settings, tmp)`` writes ``settings`` as the YAML config, starts `epd serve`, waits
for /ready and yields a ``Served``; on exit the whole process group is killed. ``in_threads`` runs a
client's calls concurrently against it, ``chat_concurrently`` a batch of chat completions.
"""

from __future__ import annotations

import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx


@dataclass
class Served:
    proc: subprocess.Popen
    base: str  # http://127.0.0.1:PORT
    config: Path
    env: dict[str, str]
    tmp: Path

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        """`epd ARGS --config CONFIG` against this deployment."""
        return subprocess.run([sys.executable, "-m", "controlplane.cli", *args, "--config", str(self.config)],
                              capture_output=True, text=True, env=self.env, timeout=60)

    def status(self) -> dict[str, Any]:
        out = self.cli("status", "--json")
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    def log_tail(self, chars: int = 3000) -> str:
        return (self.tmp / "serve.log").read_text()[-chars:]


T = TypeVar("T")


@contextmanager
def in_threads(call: Callable[[int], T], n: int, join_s: float) -> Iterator[list[T]]:
    """Run ``call(0) .. call(n - 1)`` on n threads while the block runs (an operator's action under load,
    or nothing). On leaving, wait up to ``join_s`` for each and fail on the first error; the yielded list
    then holds the n results in order."""
    results: list[Any] = [None] * n
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            results[i] = call(i)
        except BaseException as exc:  # noqa: BLE001 - reported below, on the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,), daemon=True) for i in range(n)]
    for t in threads:
        t.start()
    try:
        yield results
    finally:
        for t in threads:
            t.join(join_s)
    assert not any(t.is_alive() for t in threads), f"calls still running after {join_s} s"
    assert not errors, errors[:3]


def chat_concurrently(client: Any, model: str, prompts: list[str], max_tokens: int, join_s: float) -> list[str]:
    """Each prompt as one greedy chat completion through the openai ``client``, all at once; the answers'
    texts in prompt order."""
    def one(i: int) -> str:
        out = client.chat.completions.create(model=model, messages=[{"role": "user", "content": prompts[i]}],
                                             max_tokens=max_tokens, temperature=0)
        return out.choices[0].message.content

    with in_threads(one, len(prompts), join_s) as texts:
        pass
    return texts


_HANDED_OUT: set[int] = set()


def free_port() -> int:
    """A free loopback port between Ray's worker ports (10002-19999) and the kernel's ephemeral range, never
    the same one twice in a session. An ephemeral port (what binding port 0 gives) can be taken by one of the
    many sockets Ray and gRPC open while a deployment starts, before `epd serve` binds its API to it."""
    low = 32768
    with contextlib.suppress(OSError, ValueError, IndexError):
        low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    for port in random.sample(range(20000, low), k=min(200, max(0, low - 20000))):
        if port in _HANDED_OUT:
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
        _HANDED_OUT.add(port)
        return port
    with socket.socket() as s:  # no ephemeral range above 20000 here: the kernel's choice
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve_process(settings: dict[str, Any], tmp: Path, ready_timeout_s: float = 150.0,
                  args: tuple[str, ...] = ()) -> Iterator[Served]:
    """``args``: more `epd serve` flags (``--model DIR``), after ``--config``."""
    port = free_port()
    config = tmp / "epd.yaml"
    config.write_text(json.dumps({**settings, "api": {**settings.get("api", {}), "port": port}}))
    env = {**os.environ, "EPD_STATE_DIR": str(tmp / "state")}
    log = open(tmp / "serve.log", "w")  # noqa: SIM115 - closed in the finally below
    proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "serve", "--config", str(config), *args],
                            stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
    served = Served(proc, f"http://127.0.0.1:{port}", config, env, tmp)
    try:
        deadline = time.monotonic() + ready_timeout_s
        while True:
            assert proc.poll() is None, served.log_tail()
            try:
                if httpx.get(f"{served.base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "epd serve did not become ready:\n" + served.log_tail()
            time.sleep(1)
        yield served
    finally:
        if proc.poll() is None:  # Ctrl-C, as an operator would: the stack removes its Ray folder and token
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(proc.pid, signal.SIGKILL)  # whatever of the group is left (nothing, normally)
        except ProcessLookupError:
            pass
        proc.wait(30)
        log.close()
