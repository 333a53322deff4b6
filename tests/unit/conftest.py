"""Fixtures for engine tests: tiny HF checkpoints written by transformers, the demo model."""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import pytest

from engine_helpers import write_tiny_hf
from workers.runtime.default_model import write_default_checkpoint
from workers.runtime.loader import LoadedModel, load_model


@pytest.fixture(scope="session")
def tiny_hf(tmp_path_factory: pytest.TempPathFactory) -> Callable[[str], Path]:
    made: dict[str, Path] = {}

    def get(kind: str) -> Path:
        if kind not in made:
            made[kind] = write_tiny_hf(tmp_path_factory.mktemp(kind), kind)
        return made[kind]
    return get


@pytest.fixture(scope="session")
def default_ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_checkpoint(tmp_path_factory.mktemp("default-model"))


@pytest.fixture(scope="session")
def default_bundle(default_ckpt: Path) -> LoadedModel:
    return load_model(default_ckpt)
