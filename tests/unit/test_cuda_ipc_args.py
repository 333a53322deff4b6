"""The CUDA IPC handle's fields go through torch's public ``reduce_tensor`` / ``rebuild_cuda_tensor`` in the
order this torch defines them (read from ``rebuild_cuda_tensor``'s signature), checked without a GPU:
``export_handle`` takes each field from its place in ``reduce_tensor``'s arguments, and ``_rebuild`` hands
each back at its place, every handle as bytes."""

from __future__ import annotations

import inspect
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch.multiprocessing import reductions

from kvtransfer import cuda_ipc
from kvtransfer.wire import pb

pytestmark = pytest.mark.unit

PARAMS = list(inspect.signature(reductions.rebuild_cuda_tensor).parameters)
FIELDS: dict[str, Any] = {"storage_handle": b"h" * 64, "storage_size_bytes": 2 << 20, "storage_offset_bytes": 512,
          "ref_counter_handle": b"r" * 16, "ref_counter_offset": 3, "event_handle": b"e" * 64,
          "event_sync_required": True}


def test_export_takes_each_field_from_its_place(monkeypatch: pytest.MonkeyPatch) -> None:
    args = tuple(FIELDS.get(name, f"<{name}>") for name in PARAMS)
    monkeypatch.setattr(reductions, "reduce_tensor", lambda t: (reductions.rebuild_cuda_tensor, args))
    fake_cuda_tensor: Any = SimpleNamespace(device=torch.device("cuda", 0))
    h = cuda_ipc.export_handle(fake_cuda_tensor)
    assert (h.handle, h.storage_bytes, h.offset_bytes, h.ref_counter_handle, h.ref_counter_offset, h.event_handle,
            h.event_sync_required) == tuple(FIELDS.values())


@pytest.mark.parametrize("event", [b"e" * 64, b""])
def test_rebuild_hands_each_field_back_at_its_place(monkeypatch: pytest.MonkeyPatch, event: bytes) -> None:
    seen: dict[str, Any] = {}

    def rebuild(*args: Any) -> str:
        seen.update(zip(PARAMS, args, strict=True))
        return "tensor"
    monkeypatch.setattr(reductions, "rebuild_cuda_tensor", rebuild)
    f = FIELDS
    handle = pb.CudaIpcHandle(handle=f["storage_handle"], storage_bytes=f["storage_size_bytes"],
                              offset_bytes=f["storage_offset_bytes"], ref_counter_handle=f["ref_counter_handle"],
                              ref_counter_offset=f["ref_counter_offset"], event_handle=event,
                              event_sync_required=bool(event))
    lease = pb.CudaIpcLease(pool_epoch=5, segment=1, segment_bytes=1 << 20, handle=handle)
    assert cuda_ipc._rebuild(lease, torch.device("cuda", 2)) == "tensor"
    want = FIELDS | {"event_handle": event, "event_sync_required": bool(event)}
    assert {k: seen[k] for k in want} == want
    assert isinstance(seen["event_handle"], bytes), "torch's _new_shared_cuda takes the event handle as bytes only"
    assert seen["storage_device"] == 2 and seen["dtype"] == torch.uint8 and seen["requires_grad"] is False
    assert tuple(seen["tensor_size"]) == (1 << 20,) and tuple(seen["tensor_stride"]) == (1,)
    assert seen["tensor_offset"] == 0
