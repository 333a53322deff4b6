"""Which GPU a replica runs on when it sees every GPU of its node (``{pool}.gpu_visibility: host``): the
mapping from Ray's reserved GPU ids to a torch device, and the environment that keeps Ray from narrowing
CUDA_VISIBLE_DEVICES. A real Ray with declared GPUs runs it in tests/integration/test_ray_gpu_placement.py."""

from __future__ import annotations

import pytest

from controlplane.ray_env import NOSET_CUDA_VAR, reserved_cuda_device
from controlplane.settings import PoolSettings

pytestmark = [pytest.mark.unit]


@pytest.mark.parametrize(("device", "ids", "visible", "expected"), [
    ("cuda", [3], None, "cuda:3"),                      # no CUDA_VISIBLE_DEVICES: Ray's ids are CUDA's indexes
    ("cuda", ["1", "0"], None, "cuda:0"),               # cuda = the first reserved GPU, in the node's order
    ("cuda:1", ["1", "0"], None, "cuda:1"),
    ("cuda:1", ["10", "9"], None, "cuda:10"),           # index order, not text order
    ("cuda", ["6"], "4,6,7", "cuda:1"),                 # the raylet's CUDA_VISIBLE_DEVICES: position in it
    ("cuda", ["GPU-bb"], "GPU-aa, GPU-bb", "cuda:1"),    # UUIDs in CUDA_VISIBLE_DEVICES
    ("cuda:1", ["GPU-aa", "GPU-zz"], "GPU-zz,GPU-aa", "cuda:1"),  # UUIDs in the node's order, not text order
])
def test_the_engine_runs_on_the_gpu_ray_reserved(device, ids, visible, expected):
    assert reserved_cuda_device(device, ids, visible, len(ids)) == expected


@pytest.mark.parametrize(("device", "ids", "visible", "reserved", "message"), [
    ("cuda:1", [0], None, 1, "engine.device cuda:1 needs 2 GPU(s) but Ray reserved 1 for this replica (['0'])"),
    ("cuda", ["5"], "0,1", 1, "Ray reserved GPU '5', which this process's CUDA_VISIBLE_DEVICES='0,1' does not list"),
    ("cuda", ["GPU-aa"], None, 1,
     "Ray reserved GPU 'GPU-aa', which is not an index, and CUDA_VISIBLE_DEVICES is unset"),
    # a node started with --num-gpus 8 and CUDA_VISIBLE_DEVICES=0,1: Ray reports both listed GPUs to everyone
    ("cuda", ["0", "1"], "0,1", 1, "Ray reports GPUs ['0', '1'] for this replica, which reserved 1"),
    ("cuda", [], None, 1, "Ray reports GPUs [] for this replica, which reserved 1"),
])
def test_a_reservation_that_does_not_fit_the_device_is_named(device, ids, visible, reserved, message):
    with pytest.raises(ValueError) as err:
        reserved_cuda_device(device, ids, visible, reserved)
    assert message in str(err.value)


@pytest.mark.parametrize(("pool", "sees_host"), [
    ({"num_gpus": 1, "engine": {"device": "cuda"}}, True),
    ({"num_gpus": 0.5, "engine": {"device": "cuda:0"}}, True),
    ({"num_gpus": 1, "engine": {"device": "cuda"}, "gpu_visibility": "reserved"}, False),  # Ray's default
    ({"num_gpus": 0, "engine": {"device": "cuda"}}, False),  # nothing reserved: the process's own view
    ({"num_gpus": 1, "engine": {"device": "cpu"}}, False),
])
def test_only_gpu_replicas_that_see_the_host_keep_every_gpu_visible(pool, sees_host):
    ps = PoolSettings.model_validate(pool)
    env = ps.process_env()
    assert ps.sees_host_gpus is sees_host
    assert (env.get(NOSET_CUDA_VAR) == "1") is sees_host
    assert env["MALLOC_ARENA_MAX"] == "2"
