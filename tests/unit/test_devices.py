"""A configured ``cuda`` resolves to the index its tensors report, so device checks compare like with like
(a CUDA IPC chunk on ``cuda:0`` was refused by a cache configured as ``cuda``). The CUDA side is faked here:
``tests/cuda/test_cuda_graphs.py`` checks it on a GPU."""

from __future__ import annotations

import pytest
import torch

from workers.runtime.devices import on_device, resolve_device

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
