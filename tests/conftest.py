"""Shared fixtures: tiny Hugging Face checkpoints written by transformers itself."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from workers.runtime.default_model import write_default_checkpoint
from workers.runtime.loader import LoadedModel, load_model

from engine_helpers import write_tiny_hf

TinyCheckpointFactory = Callable[..., Path]

# Small enough to build and save in well under a second; GQA (4 query heads, 2 KV heads).
TINY_SHAPE: dict[str, Any] = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)


@pytest.fixture
def tiny_llama_dir(tmp_path: Path) -> TinyCheckpointFactory:
    """Factory: ``make(arch="llama"|"qwen2", tie=False, max_shard_size=None, seed=0, **config)`` writes a
    random ``LlamaForCausalLM``/``Qwen2ForCausalLM`` with ``save_pretrained`` and returns its folder.

    Every parameter (norms and biases included) is drawn from ``seed``, so a loader that swaps, drops
    or zero-fills a tensor cannot match transformers by accident.
    """
    transformers = pytest.importorskip("transformers")
    counter = iter(range(1_000_000))

    def make(arch: str = "llama", *, tie: bool = False, max_shard_size: str | None = None, seed: int = 0,
             **config: Any) -> Path:
        classes = {"llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
                   "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM)}
        config_cls, model_cls = classes[arch]
        hf_config = config_cls(**{**TINY_SHAPE, "tie_word_embeddings": tie, **config})
        model = model_cls(hf_config).eval()
        gen = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, param in model.named_parameters():  # tied weights appear once
                noise = torch.randn(param.shape, generator=gen) * 0.1
                param.copy_(1.0 + noise if name.endswith("norm.weight") else noise)
        folder = tmp_path / f"{arch}-{next(counter)}"
        kwargs = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
        model.save_pretrained(folder, **kwargs)
        return folder

    return make


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


@pytest.fixture(scope="module")
def tiny_bundle(tiny_hf: Callable[[str], Path]) -> LoadedModel:
    """The tiny GQA Llama (``tiny_hf("llama-gqa")``) loaded without a tokenizer: the engine tests' model."""
    return load_model(tiny_hf("llama-gqa"), require_tokenizer=False)


@pytest.fixture
def no_epd_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """Run with no EPD_* variable set, so settings come from the test alone (the suite may run inside an
    environment that sets some)."""
    for key in list(os.environ):
        if key.startswith("EPD_"):
            monkeypatch.delenv(key)
