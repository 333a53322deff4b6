"""Triton kernels for the engine on a GPU, each with a torch reference it is tested against.

The torch path in ``workers.runtime.attention`` / ``model`` stays the CPU implementation. These
modules import ``triton`` at import time, so import them only where Triton is wanted (``available``
says whether it is installed); under ``TRITON_INTERPRET=1`` (read when a module here is first
imported) every kernel runs on CPU tensors through Triton's interpreter.
"""

from __future__ import annotations

import importlib.util


def available() -> bool:
    """True when the ``triton`` package can be imported."""
    return importlib.util.find_spec("triton") is not None
