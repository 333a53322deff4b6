"""``DeviceAudit``: a TorchFunctionMode that records, for code under kvtransfer/ and the workers' KV files,
every tensor factory called without ``device=`` (the bug behind "index is on cpu, different from other
tensors on cuda:0") and every torch call whose tensor arguments sit on more than one device, explicit
copies between devices (staging) aside. It sees the calls of the thread that entered it only."""

from __future__ import annotations

import os
import sys
from types import FrameType

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_AUDITED = (os.path.join(_ROOT, "kvtransfer") + os.sep, os.path.join(_ROOT, "workers", "decode", "kv_sink.py"),
            os.path.join(_ROOT, "workers", "prefill", "kv_stream.py"),
            os.path.join(_ROOT, "workers", "prefill", "calibrate.py"))
_FACTORIES = {torch.tensor, torch.arange, torch.empty, torch.zeros, torch.ones, torch.full, torch.randn}
_TRANSFERS = {"copy_", "to", "cpu", "cuda"}  # moving bytes between devices on purpose (staging)


class DeviceAudit(TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.no_device: list[str] = []
        self.mixed: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        where = _caller()
        if where is not None:
            if func in _FACTORIES and "device" not in kwargs:
                self.no_device.append(f"{where}: {getattr(func, '__name__', func)} without device=")
            devices = {t.device for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)}
            if len(devices) > 1 and getattr(func, "__name__", "") not in _TRANSFERS:
                self.mixed.append(f"{where}: {getattr(func, '__name__', func)} on {sorted(map(str, devices))}")
        return func(*args, **kwargs)


def _caller() -> str | None:
    """file:line of the audited frame that made the torch call, or None when the caller is elsewhere."""
    frame: FrameType | None = sys._getframe(2)
    while frame is not None and os.sep + "torch" + os.sep in frame.f_code.co_filename:
        frame = frame.f_back
    if frame is None or not frame.f_code.co_filename.startswith(_AUDITED):
        return None
    return f"{os.path.relpath(frame.f_code.co_filename, _ROOT)}:{frame.f_lineno}"
