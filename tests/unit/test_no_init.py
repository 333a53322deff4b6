"""Modules built for a checkpoint to fill, or for their shapes only, skip torch's parameter initialisers:
no wasted random fill on the real device, and no torch._dynamo (with Triton) imported by the meta device's
decompositions in every process that loads a model. Every weight still comes from the checkpoint."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from workers.runtime.checkpoint import model_to_hf_tensors, read_hf_tensors
from workers.runtime.loader import load_model
from workers.runtime.no_init import uninitialised

pytestmark = pytest.mark.unit


def test_no_initialiser_runs_inside_and_all_run_again_after() -> None:
    """torch's initialisers draw from the global RNG: untouched inside, advanced outside."""
    state = torch.get_rng_state()
    with uninitialised():
        layers = [nn.Linear(64, 32), nn.Embedding(10, 8), nn.Conv2d(3, 4, 2), nn.LayerNorm(8)]
    assert torch.equal(torch.get_rng_state(), state)
    with uninitialised("meta"):
        meta = nn.Linear(4096, 4096)
    assert meta.weight.device.type == "meta" and layers[0].weight.device.type == "cpu"
    assert torch.equal(torch.get_rng_state(), state)
    nn.Linear(4, 4)
    assert not torch.equal(torch.get_rng_state(), state)


def test_every_weight_of_a_loaded_model_is_the_checkpoints(default_ckpt: Path) -> None:
    bundle = load_model(default_ckpt)
    stored = read_hf_tensors(default_ckpt, bundle.model.cfg)
    loaded = model_to_hf_tensors(bundle.model)
    assert loaded.keys() == stored.keys()
    assert all(torch.equal(loaded[k], stored[k].to(loaded[k].dtype)) for k in stored)


def test_loading_a_model_imports_no_dynamo_or_triton(default_ckpt: Path) -> None:
    """A fresh process, as a worker is: load the text model and the vision tower, and the encoder alone."""
    code = ("import sys; from workers.runtime.loader import load_model; "
            f"load_model({str(default_ckpt)!r}); load_model({str(default_ckpt)!r}, with_text=False); "
            "print(sorted(m for m in ('torch._dynamo', 'triton') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr
