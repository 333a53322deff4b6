"""The ``epd serve`` the chaos benchmark runs: started as a user starts it (its own process group, a
private Redis, Ray, the pools), watched through its admin API, stopped with Ctrl-C."""

from __future__ import annotations

import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx


@dataclass(frozen=True)
class Worker:
    pool: str
    worker_id: str
    address: str
    free_kv_blocks: int
    total_kv_blocks: int
    running: int
    preemptions: int = 0  # sequences its engine preempted since it started

    @property
    def port(self) -> int:
        return int(self.address.rsplit(":", 1)[1])


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Deployment:
    def __init__(self, model: Path | None, replicas: int, folder: Path, extra: dict[str, Any] | None = None,
                 kv_cache_bytes: int = 64 * 2**20) -> None:
        """``kv_cache_bytes``: each prefill and decode replica's KV pool (encode's is 32 MiB)."""
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.admin_token = secrets.token_urlsafe(24)
        self.folder = folder
        pool = {"replicas": replicas, "num_cpus": 0.25, "engine": {"kv_cache_bytes": kv_cache_bytes}}
        settings: dict[str, Any] = {
            "transfer": {"codec_policy": "fp32"},  # exact: answers must equal generate()'s
            "encode": {**pool, "engine": {"kv_cache_bytes": 32 * 2**20}}, "prefill": pool, "decode": pool,
            "api": {"port": self.port, "admin_token": self.admin_token}, **(extra or {})}
        if model is not None:
            settings["model"] = str(model)
        self.config = folder / "epd.yaml"
        self.config.write_text(json.dumps(settings))
        self.log_path = folder / "serve.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self, ready_timeout_s: float = 300.0) -> None:
        env = {**os.environ, "EPD_STATE_DIR": str(self.folder / "state")}
        log = open(self.log_path, "wb")  # noqa: SIM115 - the child holds it; closed when it exits
        self.proc = subprocess.Popen([sys.executable, "-m", "controlplane.cli", "serve", "--config", str(self.config)],
                                     stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        log.close()
        deadline = time.monotonic() + ready_timeout_s
        try:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"epd serve exited ({self.proc.returncode}):\n{self.log_tail()}")
                try:
                    if httpx.get(f"{self.base}/ready", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"epd serve not ready in {ready_timeout_s:.0f} s:\n{self.log_tail()}")
                time.sleep(1)
        except BaseException:  # not ready, or interrupted (Ctrl-C): the stack, in its own session, goes too
            self.stop()
            raise

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(30)

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:] if self.log_path.exists() else ""

    def model_card(self) -> dict[str, Any]:
        """The served model's entry in ``/v1/models`` (``id``, ``max_model_len``, ...)."""
        return dict(httpx.get(f"{self.base}/v1/models", timeout=10).json()["data"][0])

    def model_name(self) -> str:
        return str(self.model_card()["id"])

    def pools(self) -> dict[str, dict[str, Any]]:
        """The admin API's pools by name (target, ready, workers); {} while it cannot answer."""
        try:
            r = httpx.get(f"{self.base}/admin/pools", headers={"Authorization": f"Bearer {self.admin_token}"},
                          timeout=5)
            return {p["pool"]: p for p in r.json()["pools"]} if r.status_code == 200 else {}
        except (httpx.HTTPError, ValueError, KeyError):
            return {}

    def workers(self, pool: str) -> list[Worker]:
        p = self.pools().get(pool, {})
        return [Worker(pool, w["worker_id"], w["address"], w["free_kv_blocks"], w["total_kv_blocks"], w["running"],
                       w.get("preemptions", 0))
                for w in p.get("workers", ()) if not w.get("draining")]

    def ready_body(self) -> dict[str, Any]:
        try:
            return dict(httpx.get(f"{self.base}/ready", timeout=5).json())
        except (httpx.HTTPError, ValueError):
            return {}
