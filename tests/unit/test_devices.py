"""A configured ``cuda`` resolves to the index its tensors report, so device checks compare like with like
(a CUDA IPC chunk on ``cuda:0`` was refused by a cache configured as ``cuda``). The CUDA side is faked here:
``tests/cuda/test_cuda_graphs.py`` checks it on a GPU."""

from __future__ import annotations

import pytest
import torch

from workers.runtime.devices import memory_baseline, note_memory_baseline, on_device, resolve_device
from workers.runtime.errors import CapacityError
from workers.runtime.gpu_memory import kv_budget, own_outside_torch

pytestmark = [pytest.mark.unit]


def test_plain_cuda_resolves_to_the_current_device(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert resolve_device("cuda") == torch.device("cuda", 1)
    assert resolve_device(torch.device("cuda")) == torch.device("cuda", 1)
    assert resolve_device("cuda:0") == torch.device("cuda", 0)  # an index given stays
    assert resolve_device("cpu") == torch.device("cpu")


def test_without_cuda_a_name_stays_as_given(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert resolve_device("cuda") == torch.device("cuda")
    assert resolve_device("cpu") == torch.device("cpu")


def test_on_device_leaves_the_cpu_alone() -> None:
    with on_device(torch.device("cpu")) as entered:
        assert entered is None
    assert isinstance(on_device(torch.device("cuda", 1)), torch.cuda.device)


GiB = 2**30


def test_memory_other_processes_held_first_is_not_this_processs() -> None:
    """gpu_memory_utilization is this process's share of the card (vLLM's meaning): memory outside torch is
    counted from what the device held when this process first loaded a model there."""
    # another process held 20 GiB when this one started; since then this one added 0.5 outside torch (libraries'
    # memory; its CUDA context came before the baseline) and 30 in torch
    assert own_outside_torch(used=int(50.5 * GiB), reserved=30 * GiB, used_then=20 * GiB, reserved_then=0) == GiB // 2
    # no baseline noted: everything in use outside torch counts as this process's
    assert own_outside_torch(used=int(50.5 * GiB), reserved=30 * GiB, used_then=0, reserved_then=0) == int(20.5 * GiB)
    # what torch reserved before the baseline (an earlier model in this process) is still torch's, never negative
    assert own_outside_torch(used=40 * GiB, reserved=40 * GiB, used_then=10 * GiB, reserved_then=10 * GiB) == 0
    assert own_outside_torch(used=10 * GiB, reserved=12 * GiB, used_then=10 * GiB, reserved_then=0) == 0


def test_the_memory_baseline_is_noted_once_per_device(monkeypatch) -> None:
    from workers.runtime import devices

    monkeypatch.setattr(devices, "_memory_baselines", {})
    used = {"now": 20 * GiB}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda index: (80 * GiB - used["now"], 80 * GiB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda index: 0)
    note_memory_baseline(torch.device("cuda", 1))
    used["now"] = 60 * GiB  # this process loaded its weights: a second note (another model) changes nothing
    note_memory_baseline(torch.device("cuda", 1))
    note_memory_baseline(torch.device("cpu"))
    assert memory_baseline(torch.device("cuda", 1)) == (20 * GiB, 0)
    assert memory_baseline(torch.device("cuda", 0)) == (0, 0)  # never noted


def test_the_pool_takes_its_share_and_a_share_that_is_not_free_is_refused() -> None:
    block = 2**20
    # alone on an 80 GiB card at 0.9: 2 GiB of weights live, 1 GiB more at the profile's peak, 0.5 outside torch
    share = int(80 * GiB * 0.9) - GiB // 2 - 3 * GiB
    assert kv_budget(80 * GiB, 77 * GiB, 0.9, GiB // 2, 3 * GiB, 2 * GiB, block) == share
    # another process holds 30 GiB: the 68.5 GiB share and the step's 1 GiB do not fit the 47 free
    with pytest.raises(CapacityError, match=r"needs 69.50 GiB, but only 47.00 GiB of the GPU are free .* lower "
                                            r"gpu_memory_utilization or set kv_cache_bytes"):
        kv_budget(80 * GiB, 47 * GiB, 0.9, GiB // 2, 3 * GiB, 2 * GiB, block)
    assert kv_budget(80 * GiB, 47 * GiB, 0.5, GiB // 2, 3 * GiB, 2 * GiB, block) == 40 * GiB - GiB // 2 - 3 * GiB
    with pytest.raises(CapacityError, match="no GPU memory left for the KV cache"):
        kv_budget(80 * GiB, 77 * GiB, 0.04, GiB // 2, 3 * GiB, 2 * GiB, block)


@pytest.mark.parametrize("device, says", [
    ("cuda", "CUDA is not available here"),
    ("cuda:3", "CUDA is not available here"),
    ("mps", "MPS is not available here"),
])
def test_a_device_this_process_lacks_is_refused_by_name_before_anything_loads(monkeypatch, tmp_path, device,
                                                                              says) -> None:
    """A replica configured for cuda on a host whose torch has no CUDA ended in a bare AssertionError
    (`epd serve`: "1 of 1 decode replicas failed to start: ...: AssertionError")."""
    from workers.runtime.errors import DeviceUnavailableError
    from workers.runtime.loader import load_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    monkeypatch.setattr(torch.backends.mps, "is_available", lambda: False)
    with pytest.raises(DeviceUnavailableError, match=f"device {device}: {says}"):
        load_model(tmp_path / "not-read", device=device)  # refused before the folder is looked at
    with pytest.raises(DeviceUnavailableError, match=f"device {device}: {says}"):
        load_model(tmp_path / "not-read", vision_device=device)


def test_a_gpu_index_past_the_count_is_refused_by_name(monkeypatch) -> None:
    from workers.runtime.devices import device_problem

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert device_problem("cuda:2") == "this machine has 2 CUDA device(s)"
    assert device_problem("cuda:1") is None and device_problem("cuda") is None and device_problem("cpu") is None
