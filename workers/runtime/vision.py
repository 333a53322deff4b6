"""CLIP ViT encoder plus LLaVA projector: the encode stage's engine (pixels -> prompt embeddings; images.py
makes the pixels from image bytes).

Parameter names match HF ``CLIPVisionModel`` / ``LlavaForConditionalGeneration``, so a CLIP checkpoint
loads as is. Checkpoint layout, under the LM folder: ``vision/config.json`` + ``vision/model.safetensors``
(an HF CLIPVisionModel), ``vision/projector.safetensors`` and ``vision/epd_vision.json``.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch
import torch.nn.functional as F
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from workers.runtime.checkpoint import check_finite
from workers.runtime.errors import CheckpointError, UnsupportedArchitectureError
from workers.runtime.fingerprint import module_fingerprint

# Preprocessing lives in images.py (which imports this module for types only); these names stay importable
# from here, where callers have found them.
from workers.runtime.images import preprocess_image, preprocess_images, preprocess_pil_image  # noqa: F401

VISION_SUBDIR = "vision"
# weight file -> the state-dict prefix it holds (CLIP tower as HF writes it; LLaVA projector)
_FILES = (("model.safetensors", "vision_model."), ("projector.safetensors", "multi_modal_projector."))
SUPPORTED_ACTS = ("quick_gelu", "gelu")
SUPPORTED_RESAMPLE = {2: "bilinear", 3: "bicubic"}  # PIL's (and HF's PILImageResampling) numbering
CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
CLIP_STD = (0.26862954, 0.26130258, 0.27577711)


@dataclass(frozen=True)
class VisionConfig:
    """Shape of the ViT and projector, plus the preprocessing constants that go with its weights."""

    image_size: int
    patch_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    text_hidden_size: int
    num_channels: int = 3
    layer_norm_eps: float = 1e-5
    hidden_act: str = "quick_gelu"
    # hidden_states index of the features (0 = embeddings, i = after layer i; negative from the end), or
    # several, whose features are concatenated (LLaVA's list form)
    vision_feature_layer: int | tuple[int, ...] = -2
    image_mean: tuple[float, ...] = CLIP_MEAN
    image_std: tuple[float, ...] = CLIP_STD
    projector_hidden_act: str = "gelu"
    # LLaVA's vision_feature_select_strategy: "default" drops the CLS position, "full" keeps it
    feature_select: Literal["default", "full"] = "default"
    projector_bias: bool = True  # LLaVA's multimodal_projector_bias
    # The image processor's: the short side is resized to this (None: image_size), with this PIL filter,
    # then centre-cropped to image_size, then scaled by rescale_factor and normalised by image_mean/std.
    resize_shortest_edge: int | None = None
    resample: int = 3
    rescale_factor: float = 1 / 255
    # LlavaImageProcessor's do_pad: first pad to a square of this RGB colour (int(image_mean * 255)); None: no pad
    pad_color: tuple[int, int, int] | None = None

    def __post_init__(self) -> None:
        for name in ("image_size", "patch_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "text_hidden_size", "num_channels"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise CheckpointError(f"vision config: {name} must be a positive integer, got {value!r}")
        if self.num_channels != 3:
            raise CheckpointError(f"vision config: only RGB images are supported, num_channels={self.num_channels}")
        if self.image_size % self.patch_size:
            raise CheckpointError(f"vision config: image_size ({self.image_size}) is not a multiple of "
                                  f"patch_size ({self.patch_size})")
        if self.hidden_size % self.num_attention_heads:
            raise CheckpointError(f"vision config: hidden_size ({self.hidden_size}) is not a multiple of "
                                  f"num_attention_heads ({self.num_attention_heads})")
        if not isinstance(self.layer_norm_eps, (int, float)) or not self.layer_norm_eps > 0:
            raise CheckpointError(f"vision config: layer_norm_eps must be positive, got {self.layer_norm_eps!r}")
        for name in ("hidden_act", "projector_hidden_act"):
            if getattr(self, name) not in SUPPORTED_ACTS:
                raise CheckpointError(f"vision config: {name}={getattr(self, name)!r} is not supported "
                                      f"(supported: {', '.join(SUPPORTED_ACTS)})")
        n = self.num_hidden_layers
        layers = self.vision_feature_layer if isinstance(self.vision_feature_layer, tuple) else (
            self.vision_feature_layer,)
        # hidden_states has n + 1 entries (embeddings, then one per layer); each index must name one of them
        if not layers or not all(isinstance(x, int) and not isinstance(x, bool) and -(n + 1) <= x <= n
                                 for x in layers):
            raise CheckpointError(f"vision config: vision_feature_layer must be an integer in [{-(n + 1)}, {n}] "
                                  f"(or a list of them) for {n} layers, got {self.vision_feature_layer!r}")
        for name in ("image_mean", "image_std"):
            value = getattr(self, name)
            if (not isinstance(value, tuple) or len(value) != self.num_channels
                    or not all(isinstance(v, (int, float)) for v in value)):
                raise CheckpointError(f"vision config: {name} must be {self.num_channels} numbers, got {value!r}")
        if not all(s > 0 for s in self.image_std):
            raise CheckpointError(f"vision config: image_std must be positive, got {self.image_std!r}")
        if self.feature_select not in ("default", "full"):
            raise CheckpointError(f"vision config: vision_feature_select_strategy must be 'default' or 'full', "
                                  f"got {self.feature_select!r}")
        edge = self.resize_shortest_edge
        if edge is not None and (not isinstance(edge, int) or isinstance(edge, bool) or edge < self.image_size):
            raise CheckpointError(f"vision config: the resize target (shortest_edge {edge!r}) must be an integer "
                                  f">= the crop size {self.image_size}")
        if self.resample not in SUPPORTED_RESAMPLE:
            raise CheckpointError(f"vision config: resample {self.resample!r} is not supported (supported: "
                                  + ", ".join(f"{k} ({v})" for k, v in SUPPORTED_RESAMPLE.items()) + ")")
        color = self.pad_color
        if color is not None and (not isinstance(color, tuple) or len(color) != 3
                                  or not all(isinstance(c, int) and 0 <= c <= 255 for c in color)):
            raise CheckpointError(f"vision config: pad_color must be 3 integers in [0, 255], got {color!r}")
        if not isinstance(self.rescale_factor, (int, float)) or not self.rescale_factor > 0:
            raise CheckpointError(f"vision config: rescale_factor must be positive, got {self.rescale_factor!r}")

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_image_tokens(self) -> int:
        """Embeddings per image: one per patch, plus the CLS position when ``feature_select`` is "full"."""
        return self.num_patches + (1 if self.feature_select == "full" else 0)

    @property
    def feature_layers(self) -> tuple[int, ...]:
        """The hidden_states indices whose features are used, in order, each in [0, num_hidden_layers]."""
        layers = self.vision_feature_layer if isinstance(self.vision_feature_layer, tuple) else (
            self.vision_feature_layer,)
        return tuple(x if x >= 0 else self.num_hidden_layers + 1 + x for x in layers)

    @property
    def feature_depth(self) -> int:
        """How many encoder layers run: later ones do not contribute to the selected features."""
        return max(self.feature_layers)


def default_vision_config(text_hidden_size: int) -> VisionConfig:
    """A small, CPU-friendly ViT: 112px images, 14px patches, 64 image tokens."""
    return VisionConfig(image_size=112, patch_size=14, hidden_size=256, intermediate_size=1024,
                        num_hidden_layers=4, num_attention_heads=4, text_hidden_size=text_hidden_size)


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
    with torch.device("meta"):
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
    """Whether a model folder carries a vision tower (i.e. is multimodal)."""
    return (Path(directory) / VISION_SUBDIR / "config.json").is_file()


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
        save_file({k: v for k, v in state.items() if k.startswith(prefix)}, str(out / name), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(hf_config, indent=2) + "\n")
    (out / "epd_vision.json").write_text(json.dumps(epd, indent=2) + "\n")


def load_vision_config(directory: Path) -> VisionConfig:
    """Parse ``directory/vision/config.json`` and ``epd_vision.json`` into a validated VisionConfig."""
    vdir = Path(directory) / VISION_SUBDIR
    hf, epd = _read_json(vdir / "config.json"), _read_json(vdir / "epd_vision.json")
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
    with torch.device("meta"):  # shapes only; the real tensors come from the files
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
            for name, shape in expected.items():
                # transformers 5 saves CLIPVisionModel without the "vision_model." prefix that 4.x and the Hub use
                key = name if name in keys else name.removeprefix("vision_model.")
                if key not in keys:
                    raise CheckpointError(f"{path}: tensor {name!r} is missing")
                tensor = f.get_tensor(key)
                if tuple(tensor.shape) != shape or not tensor.is_floating_point():
                    raise CheckpointError(f"{path}: tensor {name!r} has shape {list(tensor.shape)} and dtype "
                                          f"{tensor.dtype}, expected a float tensor of shape {list(shape)}")
                check_finite(tensor, name, str(path))
                out[name] = tensor
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: not a readable safetensors file: {exc}") from None
    return out


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file is missing") from None
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data


def _as_tuple(value: Any) -> Any:
    return tuple(value) if isinstance(value, list) else value  # JSON lists; anything else fails validation

