"""The encode stage's engine: CLIP ViT + LLaVA projector, preprocessing and checkpoint I/O."""

from __future__ import annotations

import dataclasses
import io
import json
import struct
import zlib
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from workers.runtime.errors import CheckpointError, InvalidImageError, UnsupportedArchitectureError
from workers.runtime.vision import (
    VisionConfig,
    build_default_vision_encoder,
    build_vision_encoder,
    default_vision_config,
    encode_images,
    has_vision,
    load_vision,
    load_vision_config,
    preprocess_image,
    preprocess_pil_image,
    save_vision,
)

pytestmark = [pytest.mark.unit]

TEXT_HIDDEN = 64


def _pixels(batch: int = 2, seed: int = 1) -> torch.Tensor:
    return torch.randn(batch, 3, 112, 112, generator=torch.Generator().manual_seed(seed))


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> Image.Image:
    channels = len(Image.new(mode, (1, 1)).getbands())
    data = torch.randint(0, 256, (width * height * channels,), generator=torch.Generator().manual_seed(seed))
    return Image.frombytes(mode, (width, height), bytes(data.to(torch.uint8).tolist()))


def _encode(image: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt)
    return buf.getvalue()


def _png_with_size(width: int, height: int) -> bytes:
    """A valid PNG header that claims width x height; Pillow reads the size without decoding pixels."""
    data = bytearray(_encode(_image(4, 4), "PNG"))
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    return bytes(data)


# ---------------------------------------------------------------- parity with transformers

@pytest.mark.transformers
@pytest.mark.parametrize(("feature_layer", "act"), [(-2, "quick_gelu"), (-1, "gelu"), (0, "quick_gelu"), (2, "gelu")])
def test_matches_transformers_clip_vision_model(tmp_path: Path, feature_layer: int, act: str) -> None:
    from transformers import CLIPVisionModel

    cfg = dataclasses.replace(default_vision_config(TEXT_HIDDEN), vision_feature_layer=feature_layer, hidden_act=act)
    encoder = build_vision_encoder(cfg, seed=3)
    save_vision(tmp_path, encoder)
    hf = CLIPVisionModel.from_pretrained(tmp_path / "vision", dtype=torch.float32).eval()
    projector = load_file(tmp_path / "vision" / "projector.safetensors")
    pixels = _pixels()
    with torch.no_grad():
        features = hf(pixel_values=pixels, output_hidden_states=True).hidden_states[feature_layer][:, 1:]
        w1, b1, w2, b2 = (projector[f"multi_modal_projector.linear_{i}.{kind}"] for i in (1, 2)
                          for kind in ("weight", "bias"))
        expected = torch.nn.functional.gelu(features @ w1.T + b1) @ w2.T + b2
        ours = encoder(pixels)
    assert ours.shape == (2, cfg.num_image_tokens, TEXT_HIDDEN) == (2, 64, TEXT_HIDDEN)
    assert (ours - expected).abs().max().item() <= 1e-4


def test_loads_unprefixed_clip_keys(tmp_path: Path) -> None:
    # transformers 5 saves a freshly built CLIPVisionModel without the "vision_model." prefix the Hub uses
    encoder = build_default_vision_encoder(TEXT_HIDDEN, seed=5)
    save_vision(tmp_path, encoder)
    path = tmp_path / "vision" / "model.safetensors"
    save_file({k.removeprefix("vision_model."): v for k, v in load_file(path).items()}, path)
    pixels = _pixels()
    assert torch.equal(load_vision(tmp_path)(pixels), encoder(pixels))


@pytest.mark.transformers
@pytest.mark.parametrize("size", [(300, 200), (97, 311), (112, 112), (50, 50), (1000, 3)])
def test_preprocessing_matches_clip_image_processor(size: tuple[int, int]) -> None:
    from transformers.models.clip import CLIPImageProcessorPil

    image = _image(*size)
    processor = CLIPImageProcessorPil(size={"shortest_edge": 112}, crop_size={"height": 112, "width": 112})
    expected = processor(images=image, return_tensors="pt")["pixel_values"][0]
    assert torch.allclose(preprocess_pil_image(image, default_vision_config(TEXT_HIDDEN)), expected, atol=1e-5)


# ---------------------------------------------------------------- weights, determinism, dtypes

def test_save_load_round_trip_is_exact(tmp_path: Path) -> None:
    encoder = build_default_vision_encoder(TEXT_HIDDEN, seed=7)
    save_vision(tmp_path, encoder)
    loaded = load_vision(tmp_path)
    assert loaded.config == encoder.config
    pixels = _pixels()
    assert torch.equal(loaded(pixels), encoder(pixels))
    config = json.loads((tmp_path / "vision" / "config.json").read_text())
    assert config["architectures"] == ["CLIPVisionModel"] and config["model_type"] == "clip_vision_model"


def test_seeded_build_is_deterministic_and_leaves_global_rng_alone() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    a, b = build_default_vision_encoder(TEXT_HIDDEN, seed=1), build_default_vision_encoder(TEXT_HIDDEN, seed=1)
    c = build_default_vision_encoder(TEXT_HIDDEN, seed=2)
    assert torch.equal(torch.get_rng_state(), before)
    sa, sb, sc = a.state_dict(), b.state_dict(), c.state_dict()
    assert all(torch.equal(sa[k], sb[k]) for k in sa)
    assert not torch.equal(sa["vision_model.encoder.layers.0.self_attn.q_proj.weight"],
                           sc["vision_model.encoder.layers.0.self_attn.q_proj.weight"])
    assert torch.equal(sa["vision_model.pre_layrnorm.weight"], torch.ones(256))
    assert torch.equal(sa["multi_modal_projector.linear_1.bias"], torch.zeros(TEXT_HIDDEN))


def test_bfloat16_is_close_to_float32(tmp_path: Path) -> None:
    save_vision(tmp_path, build_default_vision_encoder(TEXT_HIDDEN))
    pixels = _pixels()
    full = load_vision(tmp_path)(pixels)
    half = load_vision(tmp_path, dtype=torch.bfloat16)(pixels)
    assert half.dtype == torch.bfloat16
    assert (half.float() - full).abs().max().item() <= 0.05 * full.abs().max().item()


def test_encode_images_returns_one_tensor_per_image() -> None:
    encoder = build_default_vision_encoder(TEXT_HIDDEN)
    images = list(_pixels(3).unbind(0))
    out = encode_images(encoder, images)
    assert [t.shape for t in out] == [torch.Size([64, TEXT_HIDDEN])] * 3
    assert torch.allclose(out[1], encoder(images[1][None])[0], atol=1e-5)
    assert encode_images(encoder, []) == []
    with pytest.raises(ValueError, match=r"pixel_values must be \[batch, 3, 112, 112\]"):
        encoder(torch.zeros(1, 3, 64, 64))


# ---------------------------------------------------------------- config validation

@pytest.mark.parametrize(("change", "message"), [
    ({"hidden_size": 250}, "not a multiple of num_attention_heads"),
    ({"image_size": 100}, "not a multiple of patch_size"),
    ({"num_hidden_layers": 0}, "num_hidden_layers must be a positive integer"),
    ({"vision_feature_layer": -6}, r"vision_feature_layer must be an integer in \[-5, 4\]"),
    ({"hidden_act": "relu"}, "hidden_act='relu' is not supported"),
    ({"image_std": (1.0, 0.0, 1.0)}, "image_std must be positive"),
    ({"image_mean": (0.5, 0.5)}, "image_mean must be 3 finite numbers"),
    ({"num_channels": 1}, "only RGB"),
])
def test_bad_config_is_refused(change: dict, message: str) -> None:
    with pytest.raises(CheckpointError, match=message):
        dataclasses.replace(default_vision_config(TEXT_HIDDEN), **change)


def test_default_config_is_small() -> None:
    cfg = default_vision_config(TEXT_HIDDEN)
    assert (cfg.image_size, cfg.patch_size, cfg.num_image_tokens, cfg.text_hidden_size) == (112, 14, 64, TEXT_HIDDEN)


# ---------------------------------------------------------------- corrupt checkpoints

@pytest.fixture
def saved(tmp_path: Path) -> Path:
    save_vision(tmp_path, build_default_vision_encoder(TEXT_HIDDEN))
    return tmp_path


def _rewrite(path: Path, edit) -> None:
    tensors = load_file(path)
    edit(tensors)
    save_file(tensors, path)


def test_missing_tensor_is_named(saved: Path) -> None:
    name = "vision_model.encoder.layers.2.mlp.fc1.bias"
    _rewrite(saved / "vision" / "model.safetensors", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{name}' is missing"):
        load_vision(saved)


def test_wrongly_shaped_tensor_is_named(saved: Path) -> None:
    name = "multi_modal_projector.linear_2.weight"
    _rewrite(saved / "vision" / "projector.safetensors", lambda t: t.update({name: torch.zeros(3, 3)}))
    with pytest.raises(CheckpointError, match=rf"projector\.safetensors: tensor '{name}' has shape \[3, 3\]"):
        load_vision(saved)


def test_a_non_finite_vision_weight_is_named(saved: Path) -> None:
    name = "vision_model.encoder.layers.1.mlp.fc2.weight"

    def poison(tensors: dict[str, torch.Tensor]) -> None:
        tensors[name] = tensors[name].clone()
        tensors[name][0, 0] = float("nan")
    _rewrite(saved / "vision" / "model.safetensors", poison)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{name}' holds 1 NaN or infinite value"):
        load_vision(saved)


def test_missing_or_unreadable_files(saved: Path) -> None:
    (saved / "vision" / "projector.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(CheckpointError, match="projector.safetensors: not a readable safetensors file"):
        load_vision(saved)
    (saved / "vision" / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="model.safetensors: file is missing"):
        load_vision(saved)
    (saved / "vision" / "epd_vision.json").write_text("{")
    with pytest.raises(CheckpointError, match="epd_vision.json: not valid JSON"):
        load_vision(saved)


def test_a_vision_config_that_is_a_folder_is_named_not_taken_for_text_only(saved: Path) -> None:
    config_path = saved / "vision" / "config.json"
    config_path.unlink()
    config_path.mkdir()
    assert has_vision(saved)
    with pytest.raises(CheckpointError, match=r"vision/config\.json: is a folder, not a file"):
        load_vision(saved)


def test_bad_json_configs(saved: Path) -> None:
    config_path = saved / "vision" / "config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps({**config, "model_type": "siglip_vision_model"}))
    with pytest.raises(UnsupportedArchitectureError, match="'siglip_vision_model' is not supported"):
        load_vision_config(saved)
    del config["hidden_size"]
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError, match="key 'hidden_size' is missing"):
        load_vision_config(saved)


# ---------------------------------------------------------------- preprocessing

@pytest.mark.parametrize("fmt", ["PNG", "JPEG", "WEBP", "GIF"])
def test_preprocess_supported_formats(fmt: str) -> None:
    cfg = default_vision_config(TEXT_HIDDEN)
    out = preprocess_image(_encode(_image(160, 90), fmt), cfg)
    assert out.shape == (3, 112, 112) and out.dtype == torch.float32
    assert out.min() >= -1.8 and out.max() <= 2.2  # [0, 1] scaled by CLIP mean/std


def test_preprocess_composites_transparency_on_white() -> None:
    transparent = Image.new("RGBA", (30, 20), (0, 0, 0, 0))
    white = Image.new("RGB", (30, 20), (255, 255, 255))
    cfg = default_vision_config(TEXT_HIDDEN)
    assert torch.equal(preprocess_image(_encode(transparent, "PNG"), cfg), preprocess_pil_image(white, cfg))


def test_preprocess_thin_strip_stays_bounded() -> None:
    # a naive resize-then-crop would make this a 112 x 224000 intermediate
    out = preprocess_image(_encode(_image(2000, 1), "PNG"), default_vision_config(TEXT_HIDDEN))
    assert out.shape == (3, 112, 112) and torch.isfinite(out).all()


@pytest.mark.parametrize(("data", "message"), [
    (b"", "image is empty"),
    (b"definitely not an image", "is not a decodable image; supported: PNG, JPEG"),
    (_encode(_image(8, 8), "BMP"), "unsupported image format BMP"),
    (_encode(_image(64, 64), "PNG")[:80], "PNG image is corrupt or truncated"),
    (_png_with_size(9000, 9000), "image is too large: 9000x9000 pixels"),
    (_png_with_size(20000, 20000), "image is too large"),  # past Pillow's own bomb limit
])
def test_preprocess_rejects_bad_images(data: bytes, message: str) -> None:
    with pytest.raises(InvalidImageError, match=message):
        preprocess_image(data, default_vision_config(TEXT_HIDDEN))


def test_vision_config_is_hashable_and_frozen() -> None:
    cfg = default_vision_config(TEXT_HIDDEN)
    assert hash(cfg) == hash(default_vision_config(TEXT_HIDDEN))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.image_size = 224  # type: ignore[misc]  # frozen: the test
    assert isinstance(cfg, VisionConfig)
