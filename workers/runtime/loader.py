"""Load a Hugging Face checkpoint folder into an engine-ready bundle.

A folder holds ``config.json``, ``*.safetensors`` (optionally sharded with an index),
``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``),
``generation_config.json`` and, for multimodal models, either a ``vision/`` subfolder (epd's own layout,
vision.py) or, for a ``LlavaForConditionalGeneration`` folder, the CLIP tower and projector beside the
language model in the same weights (llava.py). A folder with neither is a text-only model: it takes no
images and needs no encode pool.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from workers.runtime import llava
from workers.runtime.checkpoint import load_into, read_hf_tensors
from workers.runtime.config import ModelConfig, is_llava, parse_token_ids, read_json_object
from workers.runtime.devices import device_problem
from workers.runtime.errors import CheckpointError, DeviceUnavailableError
from workers.runtime.model import DecoderModel
from workers.runtime.no_init import uninitialised
from workers.runtime.tokenizer import Tokenizer
from workers.runtime.vision import (
    VisionConfig,
    VisionEncoder,
    has_vision,
    load_vision,
    load_vision_config,
)


@dataclass(frozen=True)
class ImageInput:
    """How a multimodal model takes images: the placeholder token, the tower's shape and preprocessing."""

    image_token_id: int
    vision: VisionConfig

    @property
    def tokens_per_image(self) -> int:
        return self.vision.num_image_tokens


def image_input(folder: Path, tokenizer: Tokenizer | None) -> ImageInput | None:
    """None for a text-only model; else its image placeholder and vision config, read without any weights.
    Sets ``tokenizer.image_token`` from a LLaVA config's ``image_token_index`` where the tokenizer's files
    name none. CheckpointError when the tokenizer and the config disagree about the placeholder."""
    folder = Path(folder)
    raw = read_json_object(folder / "config.json")
    cfg = ModelConfig.from_hf_dict(raw)
    if is_llava(raw):
        vision = llava.vision_config(folder, raw, cfg.hidden_size)
        token_id = llava.image_token_id(raw, cfg.vocab_size)
        if tokenizer is not None:
            named = tokenizer.token_to_id(tokenizer.image_token) if tokenizer.image_token is not None else None
            if tokenizer.image_token is not None and named != token_id:
                raise CheckpointError(f"{folder}: the tokenizer's image_token {tokenizer.image_token!r} is id "
                                      f"{named}, but config.json says image_token_index={token_id}")
            text = tokenizer.backend.id_to_token(token_id)
            if text is None:
                raise CheckpointError(f"{folder}: config.json's image_token_index {token_id} is not in the tokenizer")
            tokenizer.image_token = text
        return ImageInput(token_id, vision)
    if not has_vision(folder):
        return None
    vision = load_vision_config(folder)
    if vision.text_hidden_size != cfg.hidden_size:
        raise CheckpointError(f"{folder}/vision: projector outputs {vision.text_hidden_size} "
                              f"features but the language model's hidden_size is {cfg.hidden_size}")
    known: int | None = None
    if tokenizer is not None and tokenizer.image_token is not None:
        known = tokenizer.token_to_id(tokenizer.image_token)
    if known is None:
        raise CheckpointError(f"{folder}: has a vision tower but tokenizer_config.json names no image_token "
                              "that the tokenizer knows")
    return ImageInput(known, vision)


def needs_encoder(folder: Path) -> bool:
    """Whether the model has a vision tower (so its deployment needs an encode pool); reads config only."""
    folder = Path(folder)
    return has_vision(folder) or is_llava(read_json_object(folder / "config.json"))


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
               require_tokenizer: bool = True, with_vision: bool = True, with_text: bool = True,
               vision_device: str | None = None) -> LoadedModel:
    """Read a checkpoint folder; any problem raises CheckpointError naming the file or tensor.

    ``with_text=False``: the text model is built on the ``meta`` device (shapes only: no memory, no weights
    read), for a worker that only encodes images. ``vision_device``: where the vision tower goes (default
    ``device``), e.g. the CPU for a prefill worker that only needs its fingerprint."""
    for where in {device, vision_device or device} if with_vision else {device}:
        problem = device_problem(where)
        if problem is not None:
            raise DeviceUnavailableError(f"device {where}: {problem}")
    folder = Path(folder)
    if not folder.exists():
        raise CheckpointError(f"{folder}: not a checkpoint folder (it does not exist)")
    if not folder.is_dir():
        raise CheckpointError(f"{folder}: is not a folder (a checkpoint is a folder holding config.json)")
    raw = read_json_object(folder / "config.json")
    cfg = ModelConfig.from_hf_dict(raw)
    llava_folder = is_llava(raw)
    if with_text:
        tensors = read_hf_tensors(folder, cfg, rename=llava.text_tensor_name if llava_folder else None)
        with uninitialised():  # load_into writes every weight
            model = DecoderModel(cfg, dtype=dtype, device=device)
        load_into(model, tensors)
        del tensors
    else:
        with uninitialised():
            model = DecoderModel(cfg, dtype=dtype, device="meta")
    tokenizer = None
    if require_tokenizer or (folder / "tokenizer.json").exists():
        tokenizer = Tokenizer.from_folder(folder)
        if tokenizer.vocab_size > cfg.vocab_size:
            raise CheckpointError(
                f"{folder / 'tokenizer.json'}: the tokenizer produces token ids up to {tokenizer.vocab_size - 1}, "
                f"but config.json's vocab_size is {cfg.vocab_size}")
    eos = read_generation_eos(folder, cfg.vocab_size) or cfg.eos_token_ids
    encoder = None
    if with_vision and needs_encoder(folder):
        images = image_input(folder, tokenizer)
        assert images is not None
        where = device if vision_device is None else vision_device
        encoder = (llava.load_llava_vision(folder, images.vision, device=where, dtype=dtype) if llava_folder
                   else load_vision(folder, device=where, dtype=dtype))
    elif llava_folder and tokenizer is not None:
        image_input(folder, tokenizer)  # the tokenizer learns the image token (prompts expand it)
    return LoadedModel(folder, cfg, model, tokenizer, eos, encoder)
