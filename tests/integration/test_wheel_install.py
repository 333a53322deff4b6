"""`pip install .` from a clean clone gives a working install: a wheel built from `git archive HEAD` (so only
committed files, none of the generated code a developer's checkout holds) carries the wire's generated Python
code, installs into a fresh virtualenv, and serves a request through its own `epd serve`.

Needs the package index pip is configured with (dependencies; torch from a local wheel where --find-links
names one), git and redis-server; it takes minutes, hence `slow`. It tests HEAD: commit first.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

import httpx
import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from http_helpers import free_loopback_port

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
GENERATED = ("epd/worker/v1/worker_pb2.py", "epd/worker/v1/worker_pb2_grpc.py", "epd/kvtransfer/v1/kvtransfer_pb2.py",
             "epd/kvtransfer/v1/kvtransfer_pb2_grpc.py")


def _run(cmd: list[str], timeout: float, **kw) -> subprocess.CompletedProcess[str]:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kw)
    assert out.returncode == 0, f"{' '.join(cmd)} failed:\n{out.stdout[-3000:]}\n{out.stderr[-3000:]}"
    return out


@pytest.fixture(scope="module")
def clean_clone(tmp_path_factory) -> Path:
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.skip("needs git and a git checkout")
    src = tmp_path_factory.mktemp("clone")
    archive = src / "head.tar"
    _run(["git", "-C", str(ROOT), "archive", "-o", str(archive), "HEAD"], 60)
    with tarfile.open(archive) as tar:
        tar.extractall(src / "epd", filter="data")
    assert not list((src / "epd" / "proto").rglob("*_pb2.py")), "generated code is committed"
    return src / "epd"


@pytest.fixture(scope="module")
def wheel(clean_clone: Path, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-w", str(out), str(clean_clone)], 600)
    (whl,) = out.glob("epd-*.whl")
    return whl


def test_the_wheel_carries_the_generated_wire_code_and_the_dashboard(wheel: Path):
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = [n for n in (*GENERATED, "controlplane/api/dashboard/index.html") if n not in names]
    assert not missing, missing
    # the licence pyproject.toml declares, as its text
    (licence,) = [n for n in names if ".dist-info/" in n and n.endswith("/LICENSE")]
    assert "Apache License" in zipfile.ZipFile(wheel).read(licence).decode()


def _floor(requirement: Requirement) -> Version:
    bounds = [Version(s.version) for s in requirement.specifier if s.operator in (">=", "==", "~=")]
    assert bounds, f"{requirement} has no lower bound"
    return max(bounds)


def test_the_generated_code_imports_under_the_oldest_grpcio_and_protobuf_the_wheel_allows(wheel: Path):
    """The generated code refuses to import under a grpcio older than the grpcio-tools that wrote it and a
    protobuf older than its protoc: the wheel's own requirements must rule both out."""
    with zipfile.ZipFile(wheel) as whl:
        grpc_code = whl.read("epd/worker/v1/worker_pb2_grpc.py").decode()
        pb2_code = whl.read("epd/worker/v1/worker_pb2.py").decode()
        (metadata,) = [n for n in whl.namelist() if n.endswith(".dist-info/METADATA")]
        requires = [Requirement(line.split(":", 1)[1].strip()) for line in whl.read(metadata).decode().splitlines()
                    if line.startswith("Requires-Dist:")]
    runtime = {r.name: r for r in requires if r.marker is None}
    grpc_generated = re.search(r"GRPC_GENERATED_VERSION = '([^']+)'", grpc_code)
    protoc = re.search(r"# Protobuf Python Version: (\S+)", pb2_code)
    assert grpc_generated and protoc
    assert _floor(runtime["grpcio"]) >= Version(grpc_generated[1]), (runtime["grpcio"], grpc_generated[1])
    assert _floor(runtime["protobuf"]) >= Version(protoc[1]), (runtime["protobuf"], protoc[1])
    assert "grpcio-tools" not in runtime, "grpcio-tools is only needed to build"


def test_a_fresh_venv_with_the_wheel_serves_a_request(wheel: Path, tmp_path: Path):
    if shutil.which("redis-server") is None:
        pytest.skip("needs redis-server")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)], 120)
    find_links = ["--find-links", "/opt/wheels"] if Path("/opt/wheels").is_dir() else []
    # CPU torch first; no bytecode compiled (nothing here depends on it, and it is a tenth of the test's time)
    _run([str(venv / "bin" / "pip"), "install", "--quiet", "--no-compile", "torch==2.13.0", *find_links], 900)
    _run([str(venv / "bin" / "pip"), "install", "--quiet", "--no-compile", str(wheel), *find_links], 900)
    # the installed package is the wheel's, not this checkout's
    where = _run([str(venv / "bin" / "python"), "-c", "import epd.worker.v1.worker_pb2 as m, controlplane as c; "
                  "print(m.__file__); print(c.__file__)"], 60, cwd=tmp_path).stdout.split()
    assert all(str(venv) in w for w in where), where

    port = free_loopback_port()
    config = tmp_path / "epd.yaml"
    config.write_text(json.dumps({"mode": "colocated", "api": {"port": port},
                                  "decode": {"replicas": 1, "num_cpus": 0.25,
                                             "engine": {"kv_cache_bytes": 32 * 2**20}}}))
    env = {k: v for k, v in os.environ.items() if not k.startswith(("EPD_", "PYTHONPATH"))}
    env["EPD_STATE_DIR"] = str(tmp_path / "state")
    log = open(tmp_path / "serve.log", "w")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(venv / "bin" / "epd"), "serve", "--config", str(config)], cwd=tmp_path, env=env,
                            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(1)
        model = httpx.get(f"{base}/v1/models").json()["data"][0]["id"]
        answer = httpx.post(f"{base}/v1/completions", json={"model": model, "prompt": "Hello", "max_tokens": 4},
                            timeout=60)
        assert answer.status_code == 200, answer.text
        assert answer.json()["usage"]["completion_tokens"] == 4
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(30)
        log.close()
    stopped = (tmp_path / "serve.log").read_text()
    assert proc.returncode in (0, 130) and "epd: stopped in" in stopped, stopped[-3000:]  # 130: Ctrl-C's status

