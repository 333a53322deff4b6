"""Shared by the CUDA tests: the skip, the model folders and HF on the same GPU."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import torch

CUDA = [pytest.mark.cuda, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# make gpu-check points this at the 1b preset it wrote; without it the tests write the tiny preset
MODEL_DIR_VAR = "GPU_CHECK_MODEL_DIR"


def preset_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    given = os.environ.get(MODEL_DIR_VAR)
    if given:
        return Path(given)
    from workers.runtime.presets import write_preset_checkpoint
    return write_preset_checkpoint(tmp_path_factory.mktemp("tiny-preset"), "tiny")


def hf_model(path: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoModelForCausalLM
    model: Any = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    return model.to("cuda").eval()
