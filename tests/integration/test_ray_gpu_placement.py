"""A real local Ray that declares two GPUs (none exist here: Ray hands out GPU ids all the same) places
replicas the way the pool manager asks (``placement_options``) and each finds its device as a replica does
(``replica.reserved_device``). With ``gpu_visibility: host`` (the default) Ray leaves CUDA_VISIBLE_DEVICES
alone, so both replicas see the node's GPUs and run on different ones of them: what lets a prefill replica
open a decode replica's CUDA IPC handles. With ``reserved`` Ray narrows the variable, as it does by default.
Replicas that reserve a fraction of a GPU start one after another (each sizes its KV pool from what the GPU
holds)."""

from __future__ import annotations

import os
import secrets
import uuid
from pathlib import Path

import pytest
import ray

from controlplane.pools import PoolManager, replica
from controlplane.pools.launch import placement_options
from controlplane.pools.ray_runtime import RayRuntime
from controlplane.settings import MiB, PoolSettings, Settings
from controlplane.state import LocalRedis

from redis_fixture import redis_server  # noqa: F401  (fixture)

pytestmark = [pytest.mark.integration, pytest.mark.slow]


@ray.remote
class Probe:
    """What a replica's process sees of its GPUs, found the way WorkerActor finds them."""

    def __init__(self, ps_json: str) -> None:
        self.ps = PoolSettings.model_validate_json(ps_json)

    def environment(self) -> dict[str, str]:
        return dict(os.environ)

    def sees(self) -> tuple[str | None, str | None, list[str]]:
        return (replica.reserved_device(self.ps), os.environ.get("CUDA_VISIBLE_DEVICES"),
                sorted(str(i) for i in ray.get_gpu_ids()))


# The control plane's secrets in its environment when it starts Ray (any case: pydantic-settings reads either)
SECRETS_IN_ENV = {"EPD_API__ADMIN_TOKEN": f"admin-canary-{uuid.uuid4().hex}",
                  "epd_api__ops_token": f"ops-canary-{uuid.uuid4().hex}",
                  "EPD_REDIS__URL": f"redis://:pw-canary-{uuid.uuid4().hex}@127.0.0.1:1/0"}


@pytest.fixture(scope="module")
def two_gpu_ray():
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("CUDA_VISIBLE_DEVICES", raising=False)  # the raylet's view: every declared GPU, by index
        for name, value in SECRETS_IN_ENV.items():
            mp.setenv(name, value)
        runtime = RayRuntime(None, f"gpu-placement-{uuid.uuid4().hex[:8]}", num_cpus=2, num_gpus=2)
        runtime.start()
        for name, value in SECRETS_IN_ENV.items():  # hidden from Ray only: the control plane keeps them
            assert os.environ[name] == value
            mp.delenv(name)  # the canaries' work is done: later Settings() here must not read them
        try:
            assert runtime.owns_connection, "another test left Ray running in this process"
            yield runtime
        finally:
            runtime.stop()


def probe_two(ps: PoolSettings) -> list[tuple[str | None, str | None, list[str]]]:
    actors = [Probe.options(**placement_options(ps)).remote(ps.model_dump_json()) for _ in range(2)]  # type: ignore[attr-defined]  # ray.remote's options
    try:
        return sorted(ray.get([a.sees.remote() for a in actors], timeout=120), key=lambda s: s[2])
    finally:
        for a in actors:
            ray.kill(a)


def test_ray_processes_do_not_inherit_the_control_planes_secrets(two_gpu_ray) -> None:
    ps = PoolSettings.model_validate({"num_cpus": 0, "num_gpus": 0})
    actor = Probe.options(**placement_options(ps)).remote(ps.model_dump_json())  # type: ignore[attr-defined]  # ray.remote's options
    try:
        env = ray.get(actor.environment.remote(), timeout=120)
    finally:
        ray.kill(actor)
    assert "RAY_AUTH_MODE" in env  # what Ray's processes do inherit
    leaked = [k for k, v in env.items() if any(secret in v for secret in SECRETS_IN_ENV.values())]
    assert leaked == [] and not {k.upper() for k in env} & {k.upper() for k in SECRETS_IN_ENV}


def test_replicas_that_see_the_host_run_on_their_reserved_gpus(two_gpu_ray):
    ps = PoolSettings.model_validate({"num_cpus": 0, "num_gpus": 1, "engine": {"device": "cuda"}})
    assert probe_two(ps) == [("cuda:0", None, ["0"]), ("cuda:1", None, ["1"])]


def test_reserved_visibility_leaves_ray_to_narrow_the_gpus(two_gpu_ray):
    ps = PoolSettings.model_validate({"num_cpus": 0, "num_gpus": 1, "engine": {"device": "cuda"},
                                      "gpu_visibility": "reserved"})
    assert probe_two(ps) == [(None, "0", ["0"]), (None, "1", ["1"])]


def test_replicas_sharing_a_gpu_start_one_after_another(two_gpu_ray, redis_server: LocalRedis,  # noqa: F811
                                                         default_ckpt: Path) -> None:
    # on the CPU (the declared GPUs do not exist), as the manager would start two replicas on half a GPU each
    token = secrets.token_urlsafe(16)
    settings = Settings(model=default_ckpt, mode="colocated", transfer={"token": token},
                        decode={"replicas": 2, "num_cpus": 0.25, "num_gpus": 0.5,
                                "engine": {"kv_cache_bytes": 32 * MiB}})
    with PoolManager(settings, redis_server.url, f"waves-{uuid.uuid4().hex[:8]}", token) as manager:
        infos = sorted(ray.get([r.actor.info.remote() for r in manager.replicas("decode")], timeout=30),
                       key=lambda i: i["index"])
    assert len(infos) == 2
    assert infos[1]["starting_at"] >= infos[0]["serving_at"], infos  # the second began once the first served
