"""CLIP ViT encoder plus LLaVA projector: the encode stage's engine (pixels -> prompt embeddings; images.py
makes the pixels from image bytes).

Parameter names match HF ``CLIPVisionModel`` / ``LlavaForConditionalGeneration``, so a CLIP checkpoint
loads as is. Checkpoint layout, under the LM folder: ``vision/config.json`` + ``vision/model.safetensors``
(an HF CLIPVisionModel), ``vision/projector.safetensors`` and ``vision/epd_vision.json``.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from workers.runtime.checkpoint import check_tensor, save_weights
from workers.runtime.config import read_json_object
from workers.runtime.errors import CheckpointError, UnsupportedArchitectureError
from workers.runtime.fingerprint import module_fingerprint

# Preprocessing lives in images.py (as the config does in vision_config.py, so that neither needs the model);
# these names stay importable from here, where callers have found them.
from workers.runtime.images import preprocess_image, preprocess_images, preprocess_pil_image  # noqa: F401
from workers.runtime.no_init import uninitialised
from workers.runtime.vision_config import CLIP_MEAN, CLIP_STD, VisionConfig, default_vision_config

VISION_SUBDIR = "vision"
# weight file -> the state-dict prefix it holds (CLIP tower as HF writes it; LLaVA projector)
_FILES = (("model.safetensors", "vision_model."), ("projector.safetensors", "multi_modal_projector."))


def _activation(name: str, x: Tensor) -> Tensor:
    if name == "quick_gelu":
        return x * torch.sigmoid(1.702 * x)
    return F.gelu(x)  # HF "gelu" is the exact (erf) form


class _Embeddings(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.patch_embedding = nn.Conv2d(cfg.num_channels, cfg.hidden_size, cfg.patch_size, cfg.patch_size, bias=False)
        self.position_embedding = nn.Embedding(cfg.num_patches + 1, cfg.hidden_size)

    def forward(self, pixel_values: Tensor) -> Tensor:
        patches = self.patch_embedding(pixel_values).flatten(2).transpose(1, 2)  # [B, N, H]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)
        # positions are always 0..N, so the whole table is added rather than looked up
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight


class _Attention(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.k_proj, self.v_proj, self.q_proj, self.out_proj = (nn.Linear(h, h) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, h = x.shape
        q, k, v = (p(x).view(b, t, self.num_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        out = F.scaled_dot_product_attention(q, k, v)  # bidirectional; default scale is head_dim ** -0.5
        return self.out_proj(out.transpose(1, 2).reshape(b, t, h))


class _Mlp(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.hidden_act
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: Tensor) -> Tensor:
        return self.fc2(_activation(self.act, self.fc1(x)))


class _EncoderLayer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.self_attn = _Attention(cfg)
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.mlp = _Mlp(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.self_attn(self.layer_norm1(x))
        return x + self.mlp(self.layer_norm2(x))


class _Encoder(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_EncoderLayer(cfg) for _ in range(cfg.num_hidden_layers))


class _VisionTransformer(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.embeddings = _Embeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)  # sic: HF's spelling
        self.encoder = _Encoder(cfg)
        # Unused by LLaVA features; kept so the state dict is a complete CLIPVisionModel.
        self.post_layernorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)


class _Projector(nn.Module):
    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.act = cfg.projector_hidden_act
        features = cfg.hidden_size * len(cfg.feature_layers)  # several feature layers are concatenated
        self.linear_1 = nn.Linear(features, cfg.text_hidden_size, bias=cfg.projector_bias)
        self.linear_2 = nn.Linear(cfg.text_hidden_size, cfg.text_hidden_size, bias=cfg.projector_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.linear_2(_activation(self.act, self.linear_1(x)))


class VisionEncoder(nn.Module):
    """pixel_values [B, 3, S, S] -> image embeddings [B, num_image_tokens, text_hidden_size]."""

    def __init__(self, cfg: VisionConfig) -> None:
        super().__init__()
        self.config = cfg
        self.vision_model = _VisionTransformer(cfg)
        self.multi_modal_projector = _Projector(cfg)

    def fingerprint(self) -> str:
        """Hash of the config and weights; the receiving prefill worker checks it in the handshake."""
        return module_fingerprint(self, "vision", dataclasses.asdict(self.config))

    def forward(self, pixel_values: Tensor) -> Tensor:
        cfg = self.config
        expected = (cfg.num_channels, cfg.image_size, cfg.image_size)
        if pixel_values.dim() != 4 or tuple(pixel_values.shape[1:]) != expected:
            raise ValueError(f"pixel_values must be [batch, {', '.join(map(str, expected))}], "
                             f"got {list(pixel_values.shape)}")
        vit = self.vision_model
        weight = vit.embeddings.patch_embedding.weight
        x = vit.pre_layrnorm(vit.embeddings(pixel_values.to(device=weight.device, dtype=weight.dtype)))
        states = [x]  # hidden_states as HF counts them: the embeddings, then each layer's output
        for layer in vit.encoder.layers[:cfg.feature_depth]:
            states.append(layer(states[-1]))
        x = torch.cat([states[i] for i in cfg.feature_layers], dim=-1) if len(cfg.feature_layers) > 1 else states[-1]
        return self.multi_modal_projector(x if cfg.feature_select == "full" else x[:, 1:])  # "default": drop CLS


def build_vision_encoder(cfg: VisionConfig, seed: int = 0) -> VisionEncoder:
    """Deterministic random weights from ``seed``; the global RNG is neither read nor advanced."""
    # Built on meta so nn's default initialisers never touch the global RNG.
    with uninitialised("meta"):
        encoder = VisionEncoder(cfg)
    encoder.to_empty(device="cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in encoder.modules():
            for name, p in module.named_parameters(recurse=False):
                if name == "bias":
                    p.zero_()
                elif isinstance(module, nn.LayerNorm):
                    p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02, generator=gen)
    return encoder.requires_grad_(False).eval()


def build_default_vision_encoder(text_hidden_size: int, seed: int = 0) -> VisionEncoder:
    return build_vision_encoder(default_vision_config(text_hidden_size), seed)


@torch.inference_mode()
def encode_images(encoder: VisionEncoder, images: list[Tensor]) -> list[Tensor]:
    """Encode preprocessed images ([3, S, S] each) as one batch; one [N, text_hidden] tensor per image."""
    if not images:
        return []
    return list(encoder(torch.stack(images)).unbind(0))


# ---------------------------------------------------------------- checkpoint I/O

def has_vision(directory: Path) -> bool:
    """Whether a model folder carries a vision tower (i.e. is multimodal): a ``vision/config.json``, which is
    then read, so one that is not a readable file is named rather than taken for a text-only model."""
    return (Path(directory) / VISION_SUBDIR / "config.json").exists()


def save_vision(directory: Path, encoder: VisionEncoder) -> None:
    """Write ``directory/vision/`` (HF CLIPVisionModel folder + projector + epd metadata)."""
    cfg = encoder.config
    out = Path(directory) / VISION_SUBDIR
    out.mkdir(parents=True, exist_ok=True)
    hf_config = {
        "architectures": ["CLIPVisionModel"], "model_type": "clip_vision_model",
        "image_size": cfg.image_size, "patch_size": cfg.patch_size, "num_channels": cfg.num_channels,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers, "num_attention_heads": cfg.num_attention_heads,
        "hidden_act": cfg.hidden_act, "layer_norm_eps": cfg.layer_norm_eps, "attention_dropout": 0.0,
    }
    epd = {
        "text_hidden_size": cfg.text_hidden_size, "vision_feature_layer": cfg.vision_feature_layer,
        "vision_feature_select_strategy": cfg.feature_select, "image_mean": list(cfg.image_mean),
        "image_std": list(cfg.image_std), "projector_hidden_act": cfg.projector_hidden_act,
        "multimodal_projector_bias": cfg.projector_bias,
    }
    state = {k: v.detach().to("cpu").contiguous() for k, v in encoder.state_dict().items()}
    for name, prefix in _FILES:
        save_weights({k: v for k, v in state.items() if k.startswith(prefix)}, out / name)
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (out / "epd_vision.json").write_text(json.dumps(epd, indent=2) + "\n")


def load_vision_config(directory: Path) -> VisionConfig:
    """Parse ``directory/vision/config.json`` and ``epd_vision.json`` into a validated VisionConfig."""
    vdir = Path(directory) / VISION_SUBDIR
    hf, epd = read_json_object(vdir / "config.json"), read_json_object(vdir / "epd_vision.json")
    if hf.get("model_type") != "clip_vision_model":
        raise UnsupportedArchitectureError(f"{vdir / 'config.json'}: model_type {hf.get('model_type')!r} is not "
                                           f"supported (expected 'clip_vision_model')")
    if epd.get("vision_feature_select_strategy", "default") not in ("default", "full"):
        raise CheckpointError(f"{vdir / 'epd_vision.json'}: vision_feature_select_strategy must be 'default' or "
                              f"'full', got {epd['vision_feature_select_strategy']!r}")
    try:
        return VisionConfig(
            **{k: hf[k] for k in ("image_size", "patch_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads")},
            num_channels=hf.get("num_channels", 3), layer_norm_eps=hf.get("layer_norm_eps", 1e-5),
            hidden_act=hf.get("hidden_act", "quick_gelu"), text_hidden_size=epd["text_hidden_size"],
            vision_feature_layer=_as_tuple(epd.get("vision_feature_layer", -2)),
            image_mean=_as_tuple(epd.get("image_mean", CLIP_MEAN)), image_std=_as_tuple(epd.get("image_std", CLIP_STD)),
            projector_hidden_act=epd.get("projector_hidden_act", "gelu"),
            feature_select=epd.get("vision_feature_select_strategy", "default"),
            projector_bias=epd.get("multimodal_projector_bias", True))
    except KeyError as exc:
        raise CheckpointError(f"{vdir}: key {exc.args[0]!r} is missing from config.json/epd_vision.json") from None


def load_vision(directory: Path, device: str | torch.device = "cpu",
                dtype: torch.dtype = torch.float32) -> VisionEncoder:
    """Load the encoder saved under ``directory/vision/``; every tensor is checked for presence and shape."""
    vdir = Path(directory) / VISION_SUBDIR
    cfg = load_vision_config(directory)
    with uninitialised("meta"):  # shapes only; the real tensors come from the files
        encoder = VisionEncoder(cfg)
    expected = {k: tuple(v.shape) for k, v in encoder.state_dict().items()}
    tensors: dict[str, Tensor] = {}
    for name, prefix in _FILES:
        tensors.update(_read_tensors(vdir / name, {k: s for k, s in expected.items() if k.startswith(prefix)}))
    encoder.load_state_dict(tensors, strict=True, assign=True)
    return encoder.to(device=device, dtype=dtype).requires_grad_(False).eval()


def _read_tensors(path: Path, expected: dict[str, tuple[int, ...]]) -> dict[str, Tensor]:
    if not path.is_file():
        raise CheckpointError(f"{path}: file is missing")
    out = {}
    try:
        with safe_open(str(path), framework="pt") as f:
            keys = set(f.keys())
            accepted = set(expected) | {n.removeprefix("vision_model.") for n in expected}
            unused = sorted(k for k in keys - accepted if not k.endswith(".position_ids"))  # an old buffer
            if unused:
                raise CheckpointError(f"{path}: holds tensors the vision config does not account for: "
                                      f"{unused[0]!r}" + (f" (and {len(unused) - 1} more)" if len(unused) > 1 else ""))
            for name, shape in expected.items():
                # transformers 5 saves CLIPVisionModel without the "vision_model." prefix that 4.x and the Hub use
                key = name if name in keys else name.removeprefix("vision_model.")
                if key not in keys:
                    raise CheckpointError(f"{path}: tensor {name!r} is missing")
                tensor = f.get_tensor(key)
                check_tensor(tensor, name, shape, str(path))
                out[name] = tensor
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None
    return out


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # JSON lists; anything else fails validation

