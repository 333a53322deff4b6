"""LLaVA checkpoints as transformers writes them (``LlavaForConditionalGeneration``), read as they are.

One folder holds ``config.json`` (``text_config``, ``vision_config``, ``image_token_index``,
``vision_feature_layer``, ``vision_feature_select_strategy``, ``projector_hidden_act``,
``multimodal_projector_bias``), the safetensors weights of all three parts, the tokenizer and, usually,
the image processor's ``preprocessor_config.json``. The weights carry the names transformers has used:

  language model  ``language_model.model.*`` + ``language_model.lm_head.*`` (the Hub's and 5.x's files)
                  or ``model.language_model.*`` + ``lm_head.*`` (the in-memory names of 4.52 and later)
  vision tower    ``vision_tower.vision_model.*`` (a 4.x CLIPVisionModel) or ``vision_tower.*`` (5.x),
                  either optionally under ``model.``
  projector       ``multi_modal_projector.linear_1/2.*``, optionally under ``model.``

The language model becomes the Llama/Qwen2 decoder (config.py, checkpoint.py); the tower and projector
become vision.py's ``VisionEncoder``, with the image processor's resize, crop, rescale and normalisation.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from workers.runtime.checkpoint import check_tensor, renamed, weight_map
from workers.runtime.config import read_json_object
from workers.runtime.errors import CheckpointError, UnsupportedArchitectureError
from workers.runtime.no_init import uninitialised
from workers.runtime.vision import VisionEncoder
from workers.runtime.vision_config import CLIP_MEAN, CLIP_STD, SUPPORTED_RESAMPLE, VisionConfig

PROCESSOR_FILE = "preprocessor_config.json"  # the image processor's own file (the Hub's LLaVA folders)
PROCESSOR_BUNDLE = "processor_config.json"  # transformers 5 nests the image processor here, as "image_processor"
_CLIP_VISION_DEFAULTS: dict[str, Any] = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12, "num_attention_heads": 12,
    "num_channels": 3, "image_size": 224, "patch_size": 32, "hidden_act": "quick_gelu", "layer_norm_eps": 1e-5}
# LlavaConfig's own vision defaults, used when config.json has no vision_config at all
_LLAVA_VISION_DEFAULTS: dict[str, Any] = {
    "model_type": "clip_vision_model", "intermediate_size": 4096, "hidden_size": 1024, "patch_size": 14,
    "image_size": 336, "num_hidden_layers": 24, "num_attention_heads": 16}
_VISION_PARTS = ("vision_tower.", "multi_modal_projector.")


def image_token_id(raw: dict[str, Any], vocab_size: int) -> int:
    """The placeholder token each image's embeddings replace (``image_token_index``, alias ``image_token_id``)."""
    value = raw.get("image_token_index", raw.get("image_token_id", 32000))
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < vocab_size:
        raise CheckpointError(f"config.json: image_token_index must be a token id in [0, {vocab_size}), "
                              f"got {value!r}")
    return value


def vision_config(folder: Path, raw: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """The CLIP tower, projector and image processor of a LLaVA folder, validated."""
    vision = raw.get("vision_config")
    if vision is None:
        vision = dict(_LLAVA_VISION_DEFAULTS)
    if not isinstance(vision, dict):
        raise CheckpointError(f"config.json: vision_config must be an object, got {vision!r:.80}")
    if vision.get("model_type", "clip_vision_model") != "clip_vision_model":
        raise UnsupportedArchitectureError(
            f"config.json: vision_config.model_type={vision.get('model_type')!r} is not supported (only a CLIP "
            f"vision tower, 'clip_vision_model')")
    v = {**_CLIP_VISION_DEFAULTS, **{k: val for k, val in vision.items() if val is not None}}
    layer = raw.get("vision_feature_layer", -2)
    layer = tuple(layer) if isinstance(layer, list) else layer  # several layers: their features concatenated
    strategy = raw.get("vision_feature_select_strategy", "default")
    bias = raw.get("multimodal_projector_bias", True)
    if not isinstance(bias, bool):
        raise CheckpointError(f"config.json: multimodal_projector_bias must be true or false, got {bias!r}")
    try:
        return VisionConfig(
            image_size=v["image_size"], patch_size=v["patch_size"], hidden_size=v["hidden_size"],
            intermediate_size=v["intermediate_size"], num_hidden_layers=v["num_hidden_layers"],
            num_attention_heads=v["num_attention_heads"], text_hidden_size=text_hidden_size,
            num_channels=v["num_channels"], layer_norm_eps=v["layer_norm_eps"], hidden_act=v["hidden_act"],
            vision_feature_layer=layer, projector_hidden_act=raw.get("projector_hidden_act", "gelu"),
            feature_select=strategy, projector_bias=bias, **image_processor(folder, v["image_size"]))
    except CheckpointError as exc:
        raise CheckpointError(f"{folder / 'config.json'}: {exc}") from None


def image_processor(folder: Path, image_size: int) -> dict[str, Any]:
    """VisionConfig's preprocessing fields from the image processor's settings (a CLIPImageProcessor's keys,
    in ``preprocessor_config.json`` or under ``image_processor`` in ``processor_config.json``); CLIP's
    defaults where there are none. What would preprocess differently from HF is refused by name."""
    path = folder / PROCESSOR_FILE
    if path.exists():
        p = read_json_object(path)
    elif (folder / PROCESSOR_BUNDLE).exists():
        path = folder / PROCESSOR_BUNDLE
        p = read_json_object(path).get("image_processor") or {}
        if not isinstance(p, dict):
            raise CheckpointError(f"{path}: image_processor must be an object, got {p!r:.80}")
    else:
        return {}

    def refuse(what: str) -> CheckpointError:
        return CheckpointError(f"{path}: {what} is not supported")

    if p.get("do_resize", True) is not True:
        raise refuse("do_resize=false")
    # LlavaImageProcessor pads to a square first; CLIPImageProcessor's do_pad only pads a batch to its largest
    # image, which after the centre crop changes nothing
    pads = bool(p.get("do_pad", False)) and str(p.get("image_processor_type", "")).startswith("LlavaImageProcessor")
    size = p.get("size", {"shortest_edge": image_size})
    edge = size if isinstance(size, int) else size.get("shortest_edge") if isinstance(size, dict) else None
    if isinstance(size, dict) and (set(size) - {"shortest_edge"} or size.get("longest_edge")):
        raise refuse(f"size={size!r} (only {{'shortest_edge': N}})")
    if not isinstance(edge, int) or isinstance(edge, bool):
        raise refuse(f"size={size!r} (only {{'shortest_edge': N}})")
    crop = p.get("crop_size", {"height": image_size, "width": image_size})
    crop_hw = (crop, crop) if isinstance(crop, int) else (crop.get("height"), crop.get("width")) \
        if isinstance(crop, dict) else None
    if p.get("do_center_crop", True) is not True or crop_hw != (image_size, image_size):
        raise CheckpointError(f"{path}: the processor must centre-crop to the vision tower's image_size "
                              f"{image_size}x{image_size}; it has do_center_crop={p.get('do_center_crop', True)!r}, "
                              f"crop_size={crop!r}")
    resample = p.get("resample", 3)
    if not isinstance(resample, int) or isinstance(resample, bool) or resample not in SUPPORTED_RESAMPLE:
        raise refuse(f"resample={resample!r} (supported: "
                     + ", ".join(f"{k} ({v})" for k, v in SUPPORTED_RESAMPLE.items()) + ")")
    out: dict[str, Any] = {"resize_shortest_edge": edge, "resample": resample}
    if pads:
        mean = _triple(p.get("image_mean", CLIP_MEAN), "image_mean", path)
        out["pad_color"] = tuple(int(m * 255) for m in mean)
    out["rescale_factor"] = p.get("rescale_factor", 1 / 255) if p.get("do_rescale", True) else 1.0
    if p.get("do_normalize", True):
        out["image_mean"] = _triple(p.get("image_mean", CLIP_MEAN), "image_mean", path)
        out["image_std"] = _triple(p.get("image_std", CLIP_STD), "image_std", path)
    else:
        out["image_mean"], out["image_std"] = (0.0, 0.0, 0.0), (1.0, 1.0, 1.0)
    return out


def _triple(value: Any, key: str, path: Path) -> tuple[float, ...]:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return (float(value),) * 3
    if isinstance(value, list) and len(value) == 3 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return tuple(float(v) for v in value)
    raise CheckpointError(f"{path}: {key} must be a number or a list of 3 numbers, got {value!r}")


# ---------------------------------------------------------------- tensor names

def _unprefixed(stored: str) -> str:
    return stored.removeprefix("model.") if stored.startswith(("model.vision_tower.", "model.multi_modal_projector.",
                                                                 "model.language_model.")) else stored


def text_tensor_name(stored: str) -> str | None:
    """A stored name -> the decoder's HF name; None for the vision tower's and projector's tensors."""
    name = _unprefixed(stored)
    if name.startswith(_VISION_PARTS):
        return None
    for old, new in (("language_model.model.", "model."), ("language_model.lm_head.", "lm_head."),
                     ("language_model.", "model.")):
        if name.startswith(old):
            return new + name[len(old):]
    return name  # lm_head.weight as 4.52+ names it; anything else is refused as unaccounted for


def vision_tensor_name(stored: str) -> str | None:
    """A stored name -> VisionEncoder's parameter name; None for the language model's tensors."""
    name = _unprefixed(stored)
    if name.startswith("multi_modal_projector."):
        return name
    if name.startswith("vision_tower."):
        rest = name.removeprefix("vision_tower.")
        return rest if rest.startswith("vision_model.") else "vision_model." + rest
    return None


def load_llava_vision(folder: Path, cfg: VisionConfig, device: str | torch.device = "cpu",
                      dtype: torch.dtype = torch.float32) -> VisionEncoder:
    """The CLIP tower and projector from a LLaVA folder's weights; each tensor checked for presence, shape,
    dtype and finiteness; a vision tensor the config does not account for is refused."""
    with uninitialised("meta"):
        encoder = VisionEncoder(cfg)
    expected = {k: tuple(v.shape) for k, v in encoder.state_dict().items()}
    files, stored = renamed(weight_map(folder), vision_tensor_name)
    unused = [stored[n] for n in files if n not in expected and not n.endswith(".position_ids")]  # an old buffer
    if unused:
        raise CheckpointError(f"{folder}: the checkpoint holds vision tensors that config.json does not account "
                              f"for: {unused[0]!r}" + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""))
    missing = [n for n in expected if n not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder}: the LLaVA checkpoint is missing the vision tensor for {missing[0]!r}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    key = stored[name]
                    t = f.get_tensor(key)
                    check_tensor(t, key, expected[name], path.name)
                    tensors[name] = t
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None
    encoder.load_state_dict(tensors, strict=True, assign=True)
    return encoder.to(device=device, dtype=dtype).requires_grad_(False).eval()
