"""Load a Hugging Face checkpoint folder into an engine-ready bundle.

A folder holds ``config.json``, ``*.safetensors`` (optionally sharded with an index),
``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``),
``generation_config.json`` and, for multimodal models, a ``vision/`` subfolder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from workers.runtime.checkpoint import load_into, read_hf_tensors
from workers.runtime.config import ModelConfig, parse_token_ids, read_json_object
from workers.runtime.errors import CheckpointError
from workers.runtime.model import DecoderModel
from workers.runtime.tokenizer import Tokenizer
from workers.runtime.vision import VisionEncoder, has_vision, load_vision


@dataclass
class LoadedModel:
    path: Path
    config: ModelConfig
    model: DecoderModel
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    vision: VisionEncoder | None = None

    @property
    def image_token_id(self) -> int | None:
        if self.tokenizer is None or self.tokenizer.image_token is None:
            return None
        return self.tokenizer.token_to_id(self.tokenizer.image_token)


def read_generation_eos(folder: Path, vocab_size: int | None = None) -> tuple[int, ...]:
    """eos ids from ``generation_config.json`` (empty if absent), each checked against ``vocab_size``."""
    path = folder / "generation_config.json"
    if not path.exists():
        return ()
    return parse_token_ids(read_json_object(path).get("eos_token_id"), "eos_token_id", str(path), vocab_size)


def load_model(folder: Path | str, dtype: torch.dtype = torch.float32, device: str = "cpu",
               require_tokenizer: bool = True, with_vision: bool = True) -> LoadedModel:
    """Read a checkpoint folder; any problem raises CheckpointError naming the file or tensor."""
    folder = Path(folder)
    if not folder.exists():
        raise CheckpointError(f"{folder}: not a checkpoint folder (it does not exist)")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: is not a folder (a checkpoint is a folder holding config.json)")
    cfg = ModelConfig.from_file(folder / "config.json")
    tensors = read_hf_tensors(folder, cfg)
    model = DecoderModel(cfg, dtype=dtype, device=device)
    load_into(model, tensors)
    del tensors
    tokenizer = None
    if require_tokenizer or (folder / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_folder(folder)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise CheckpointError(
                f"{folder}: tokenizer has {tokenizer.vocab_size} tokens but the model's vocab_size is "
                f"{cfg.vocab_size}")
    eos = read_generation_eos(folder, cfg.vocab_size) or cfg.eos_token_ids
    encoder = None
    if with_vision and has_vision(folder):
        encoder = load_vision(folder, device=device, dtype=dtype)
        if encoder.config.text_hidden_size != cfg.hidden_size:
            raise CheckpointError(f"{folder}/vision: projector outputs {encoder.config.text_hidden_size} "
                                  f"features but the language model's hidden_size is {cfg.hidden_size}")
        if tokenizer is None or tokenizer.image_token is None or tokenizer.token_to_id(tokenizer.image_token) is None:
            raise CheckpointError(f"{folder}: has a vision tower but tokenizer_config.json names no image_token "
                                  "that the tokenizer knows")
    return LoadedModel(folder, cfg, model, tokenizer, eos, encoder)
