"""Import first in Triton kernel tests: without CUDA the kernels run on CPU through Triton's
interpreter, which ``triton.jit`` picks when the kernel modules are imported, so the variable must
be set before that. With CUDA the same tests run the compiled kernels on the GPU."""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
pytest.importorskip("triton")

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
