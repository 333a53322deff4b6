"""Image bytes -> the pixel tensors a CLIP tower takes, exactly as HF's CLIPImageProcessor makes them.

Decoding is bounded (formats, pixel count) and every failure is an ``InvalidImageError`` naming the problem;
the steps and their constants come from the model's ``VisionConfig`` (vision_config.py), which llava.py fills
from a checkpoint's image processor settings.
"""

from __future__ import annotations

import io
import struct
from collections.abc import Container, Sequence

import torch
from PIL import Image, UnidentifiedImageError
from torch import Tensor

from workers.runtime.errors import ImageTooLargeError, InvalidImageError
from workers.runtime.vision_config import VisionConfig

SUPPORTED_IMAGE_FORMATS = ("PNG", "JPEG", "WEBP", "GIF")
# Below Pillow's own bomb limit (89 MP), so anything Pillow would merely warn about is refused here.
MAX_IMAGE_PIXELS = 64_000_000
MAX_RESIZED_PIXELS = 16_000_000  # bound on the intermediate of resize-then-crop


def check_image_header(data: bytes) -> None:
    """What can be told of image bytes from their header alone, without decoding a pixel: not empty, a
    supported format, a size within MAX_IMAGE_PIXELS. InvalidImageError names the problem (the API checks
    this where it can still name the request's field; the encoder checks it again, then decodes)."""
    _open_image(data)


def _open_image(data: bytes) -> Image.Image:
    if not data:
        raise InvalidImageError("image is empty (0 bytes)")
    try:
        image = Image.open(io.BytesIO(data), formats=SUPPORTED_IMAGE_FORMATS)
    except UnidentifiedImageError:
        raise InvalidImageError(_describe_undecodable(data)) from None
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as exc:
        raise ImageTooLargeError(f"image is too large: {exc}; the limit is {MAX_IMAGE_PIXELS} pixels") from None
    except (OSError, ValueError, EOFError, SyntaxError, struct.error) as exc:  # a header Pillow reads and cannot use
        raise InvalidImageError(f"image header is corrupt or truncated: {exc}") from None
    width, height = image.size
    if width <= 0 or height <= 0:
        raise InvalidImageError(f"image has zero size ({width}x{height})")
    if width * height > MAX_IMAGE_PIXELS:
        raise ImageTooLargeError(f"image is too large: {width}x{height} pixels, the limit is {MAX_IMAGE_PIXELS}")
    return image


def preprocess_image(data: bytes, cfg: VisionConfig) -> Tensor:
    """Decode image bytes and preprocess them as CLIP does; bad input raises InvalidImageError."""
    image = _open_image(data)
    try:
        image.load()  # the header parsed; decoding the pixels can still fail on truncated/corrupt data
    except (OSError, ValueError, SyntaxError, EOFError) as exc:
        raise InvalidImageError(f"{image.format} image is corrupt or truncated: {exc}") from None
    return preprocess_pil_image(image, cfg)


def preprocess_images(images: Sequence[bytes], cfg: VisionConfig, skip: Container[int] = ()) -> dict[int, Tensor]:
    """``preprocess_image`` over a request's images, by index, leaving out the indices in ``skip`` (cached);
    a bad image's InvalidImageError says which one it is ("image 2 of 3: ...", in prompt order)."""
    out: dict[int, Tensor] = {}
    for i, data in enumerate(images):
        if i in skip:
            continue
        try:
            out[i] = preprocess_image(data, cfg)
        except InvalidImageError as exc:
            raise InvalidImageError(f"image {i + 1} of {len(images)}: {exc}") from None
    return out


def _describe_undecodable(data: bytes) -> str:
    try:  # header-only probe, to tell "unsupported format" apart from "not an image at all"
        fmt = Image.open(io.BytesIO(data)).format
    except Exception:  # any failure here just means "not an image"
        fmt = None
    supported = ", ".join(SUPPORTED_IMAGE_FORMATS)
    if fmt:
        return f"unsupported image format {fmt}; supported: {supported}"
    return f"image data ({len(data)} bytes, starting {data[:8]!r}) is not a decodable image; supported: {supported}"


def _pad_to_square(image: Image.Image, color: tuple[int, int, int]) -> Image.Image:
    """LlavaImageProcessor's ``pad_to_square``: the image centred on a square of its longer side. A square past
    MAX_RESIZED_PIXELS (a thin strip) is built already shrunk to that budget: nearly the same pixels."""
    w, h = image.size
    side = max(w, h)
    scale = min(1.0, (MAX_RESIZED_PIXELS / side**2) ** 0.5)
    if scale < 1.0:
        w, h, side = max(1, round(w * scale)), max(1, round(h * scale)), max(1, round(side * scale))
        image = image.resize((w, h), Image.Resampling.BICUBIC)
    canvas = Image.new("RGB", (side, side), color)
    canvas.paste(image, ((side - w) // 2, (side - h) // 2))
    return canvas


def preprocess_pil_image(image: Image.Image, cfg: VisionConfig) -> Tensor:
    """RGB, padded to a square when ``pad_color`` is set, shortest side resized to ``resize_shortest_edge``
    (default image_size) with ``resample``, centre crop to image_size, scaling by ``rescale_factor``, mean/std
    normalisation: HF's CLIPImageProcessor, step by step."""
    if image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info):
        # composite on white as HF's convert_to_rgb does (transformers >= 5.21; before, it dropped the alpha);
        # a plain convert would turn transparent pixels black
        rgba = image.convert("RGBA")
        image = Image.alpha_composite(Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba)
    image = image.convert("RGB")
    if cfg.pad_color is not None and image.size[0] != image.size[1]:
        image = _pad_to_square(image, cfg.pad_color)
    size = cfg.image_size
    edge = cfg.resize_shortest_edge or size
    resample = Image.Resampling(cfg.resample)
    w, h = image.size
    # HF's resize target: short side = edge, long side = int(edge * long / short)
    new_w, new_h = (edge, int(edge * h / w)) if w <= h else (int(edge * w / h), edge)
    left, top = (new_w - size) // 2, (new_h - size) // 2
    if new_w * new_h <= MAX_RESIZED_PIXELS:  # exactly HF's CLIPImageProcessor: resize, then crop
        image = image.resize((new_w, new_h), resample).crop((left, top, left + size, top + size))
    else:
        # A thin strip (1 x 60M pixels) would resize to gigapixels: resample only the kept region instead.
        # Nearly the same pixels (Pillow's fixed-point path rounds a box resize slightly differently).
        sx, sy = w / new_w, h / new_h
        box = (left * sx, top * sy, (left + size) * sx, (top + size) * sy)
        image = image.resize((size, size), resample, box=box)
    pixels = torch.frombuffer(bytearray(image.tobytes()), dtype=torch.uint8).view(size, size, 3)
    # as HF rescales: in float64, then float32 (so the pixels equal its processor's bit for bit)
    x = (pixels.permute(2, 0, 1).to(torch.float64) * cfg.rescale_factor).to(torch.float32)
    mean = torch.tensor(cfg.image_mean, dtype=torch.float32).view(3, 1, 1)
    std = torch.tensor(cfg.image_std, dtype=torch.float32).view(3, 1, 1)
    return (x - mean) / std
