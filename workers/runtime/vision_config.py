"""VisionConfig: the CLIP tower's and LLaVA projector's shape, with the image processor's constants that go
with its weights, validated on construction.

Apart from the model (vision.py) so that the image preprocessing (images.py) and the LLaVA config reader
(llava.py) can take it without importing the encoder.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

from workers.runtime.errors import CheckpointError

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
        if not _finite(self.layer_norm_eps) or not self.layer_norm_eps > 0:
            raise CheckpointError(f"vision config: layer_norm_eps must be a positive number, "
                                  f"got {self.layer_norm_eps!r}")
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
                    or not all(_finite(v) for v in value)):
                raise CheckpointError(f"vision config: {name} must be {self.num_channels} finite numbers, "
                                      f"got {value!r}")
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
        if not _finite(self.rescale_factor) or not self.rescale_factor > 0:
            raise CheckpointError(f"vision config: rescale_factor must be a positive number, "
                                  f"got {self.rescale_factor!r}")
        if not isinstance(self.projector_bias, bool):
            raise CheckpointError(f"vision config: multimodal_projector_bias must be true or false, "
                                  f"got {self.projector_bias!r}")

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


def _finite(value: object) -> bool:
    """A finite int or float, and not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
