"""LLaVA folders as transformers writes them load as they are, and run as transformers' own LLaVA runs them:
the same pixels, the same number of image tokens, the same logits (1e-4, float32) and greedy tokens, image
and text together. What the engine could not run the same way is refused, by name."""

from __future__ import annotations

import io
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file, save_file

from workers.runtime.engine import Engine, EngineConfig
from workers.runtime.errors import CheckpointError, UnsupportedArchitectureError
from workers.runtime.loader import image_input, load_model, needs_encoder
from workers.runtime.multimodal import expand_image_tokens
from workers.runtime.sampler import SamplingParams
from workers.runtime.sequence import MultimodalInput
from workers.runtime.vision import encode_images, preprocess_image

from engine_helpers import assert_no_leaks, run_to_completion
from hf_checkpoints import write_llava, write_text_model

pytestmark = [pytest.mark.unit, pytest.mark.transformers]

TOL = 1e-4
STEPS = 12


def _png(width: int, height: int, seed: int, mode: str = "RGB") -> bytes:
    rng = np.random.default_rng(seed)
    channels = 4 if mode == "RGBA" else 3
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 256, (height, width, channels), dtype=np.uint8), mode).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def llava_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("llava")
    return {"llama": write_llava(root / "llama"), "qwen2": write_llava(root / "qwen2", text_arch="qwen2", seed=1),
            "full": write_llava(root / "full", strategy="full", vision_feature_layer=-1, seed=2),
            "layers": write_llava(root / "layers", vision_feature_layer=[0, -2, -1], seed=3)}


def _pil(data: bytes) -> Image.Image:
    return Image.open(io.BytesIO(data))


def _hf(folder: Path):
    import transformers

    model = transformers.LlavaForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None  # exactly STEPS tokens, as ignore_eos does here
    return model, transformers.AutoProcessor.from_pretrained(folder)


def _messages(n_images: int, text: str) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


def _hf_inputs(processor, images: list[bytes], text: str) -> dict:
    prompt = processor.apply_chat_template(_messages(len(images), text), add_generation_prompt=True)
    pil = [_pil(b) for b in images] or None
    return dict(processor(images=pil, text=prompt, return_tensors="pt"))


def _ours(folder: Path, images: list[bytes], text: str) -> tuple[list[int], list]:
    """Our prompt ids (placeholders expanded) and the engine's outputs, STEPS greedy tokens with logits."""
    bundle = load_model(folder)
    assert bundle.vision is not None and bundle.tokenizer is not None and bundle.image_token_id is not None
    ids = bundle.tokenizer.encode_chat(_messages(len(images), text))
    ids, positions = expand_image_tokens(ids, bundle.image_token_id, bundle.vision.config.num_image_tokens,
                                         len(images))
    mm = None
    if images:
        embeds = torch.cat(encode_images(bundle.vision, [preprocess_image(b, bundle.vision.config) for b in images]))
        mm = MultimodalInput(embeds, positions)
    engine = Engine(bundle.model, bundle.tokenizer, EngineConfig(kv_cache_bytes=1 << 22, prefill_chunk_size=7))
    engine.add_request("r", ids, SamplingParams(max_tokens=STEPS, temperature=0.0, ignore_eos=True,
                                                return_logits=True), mm)
    outs = run_to_completion(engine)["r"]
    assert_no_leaks(engine)
    return ids, outs


@pytest.mark.parametrize("kind", ["llama", "qwen2", "full", "layers"])
def test_logits_and_greedy_tokens_match_transformers_llava_with_an_image(llava_dirs, kind):
    folder = llava_dirs[kind]
    hf, processor = _hf(folder)
    images, text = [_png(90, 70, seed=3)], "What is in the image?"
    inputs = _hf_inputs(processor, images, text)
    ids, outs = _ours(folder, images, text)
    assert ids == inputs["input_ids"][0].tolist()  # same template, BOS and number of image tokens
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=STEPS, do_sample=False, output_logits=True,
                          return_dict_in_generate=True, pad_token_id=0)
    assert [o.new_token_ids[0] for o in outs] == ref.sequences[0, len(ids):].tolist()
    worst = max((o.logits - ref_logits[0].float()).abs().max().item() for o, ref_logits in zip(outs, ref.logits))
    assert worst <= TOL, f"max |logit diff| over {STEPS} steps = {worst}"


def test_two_images_in_one_prompt_match_transformers(llava_dirs):
    folder = llava_dirs["llama"]
    hf, processor = _hf(folder)
    images, text = [_png(64, 120, seed=4), _png(200, 56, seed=5, mode="RGBA")], "Compare them."
    inputs = _hf_inputs(processor, images, text)
    ids, outs = _ours(folder, images, text)
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        ref = hf(**inputs).logits[0, -1]
    assert (outs[0].logits - ref).abs().max().item() <= TOL


def test_the_image_changes_the_answer(llava_dirs):
    """A guard on the tests above: the image matters to these tiny models, so a wrong tower would show."""
    folder = llava_dirs["llama"]
    buf = io.BytesIO()
    Image.new("RGB", (90, 70), (250, 20, 20)).save(buf, "PNG")
    _, a = _ours(folder, [_png(90, 70, seed=3)], "What is in the image?")
    _, b = _ours(folder, [buf.getvalue()], "What is in the image?")
    assert (a[0].logits - b[0].logits).abs().max().item() > 1.0
    assert [o.new_token_ids[0] for o in a] != [o.new_token_ids[0] for o in b]


def test_text_only_request_to_a_llava_model_matches_transformers(llava_dirs):
    folder = llava_dirs["llama"]
    hf, processor = _hf(folder)
    inputs = _hf_inputs(processor, [], "Say something.")
    ids, outs = _ours(folder, [], "Say something.")
    assert ids == inputs["input_ids"][0].tolist()
    with torch.no_grad():
        ref = hf.generate(**inputs, max_new_tokens=STEPS, do_sample=False, return_dict_in_generate=True,
                          pad_token_id=0)
    assert [o.new_token_ids[0] for o in outs] == ref.sequences[0, len(ids):].tolist()


@pytest.mark.parametrize("size", [(90, 70), (70, 90), (56, 56), (300, 41), (13, 9)])
def test_pixels_equal_the_hf_image_processor(llava_dirs, size):
    import transformers

    folder = llava_dirs["llama"]
    processor = transformers.AutoProcessor.from_pretrained(folder).image_processor
    data = _png(size[0], size[1], seed=sum(size))
    cfg = image_input(folder, None).vision
    ref = processor(images=[_pil(data)], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(preprocess_image(data, cfg), ref)


def test_image_processor_settings_are_read_from_preprocessor_config(llava_dirs, tmp_path):
    """The Hub's layout: preprocessor_config.json beside the weights (its mean, std and resize are used)."""
    import shutil

    import transformers

    folder = tmp_path / "hub"
    shutil.copytree(llava_dirs["llama"], folder)
    processor = transformers.CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 56, "width": 56},
                                                image_mean=[0.5, 0.4, 0.3], image_std=[0.2, 0.3, 0.4], resample=2)
    processor.save_pretrained(folder)
    assert (folder / "preprocessor_config.json").exists()
    cfg = image_input(folder, None).vision
    assert (cfg.resize_shortest_edge, cfg.resample, cfg.image_mean) == (64, 2, (0.5, 0.4, 0.3))
    data = _png(81, 67, seed=8)
    ref = processor(images=[_pil(data)], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(preprocess_image(data, cfg), ref)


@pytest.mark.parametrize("size", [(90, 50), (40, 120), (64, 64)])
def test_llava_image_processor_pads_to_a_square_as_transformers_does(llava_dirs, tmp_path, size):
    """LlavaImageProcessor with do_pad: the image centred on a square of int(mean * 255) first."""
    import shutil

    import transformers

    folder = tmp_path / "padded"
    shutil.copytree(llava_dirs["llama"], folder)
    processor = transformers.LlavaImageProcessor(do_pad=True, size={"shortest_edge": 56},
                                                 crop_size={"height": 56, "width": 56}, image_mean=[0.2, 0.5, 0.9])
    processor.save_pretrained(folder)
    cfg = image_input(folder, None).vision
    assert cfg.pad_color == (51, 127, 229)
    data = _png(size[0], size[1], seed=size[0])
    ref = processor(images=[_pil(data)], return_tensors="pt")["pixel_values"][0]
    assert torch.equal(preprocess_image(data, cfg), ref)


def test_a_llava_folder_needs_an_encoder_and_a_text_only_one_does_not(llava_dirs, tmp_path):
    text = write_text_model(tmp_path / "text")
    assert needs_encoder(llava_dirs["llama"]) and not needs_encoder(text)
    bundle = load_model(text)
    assert bundle.vision is None and bundle.image_token_id is None and image_input(text, bundle.tokenizer) is None
    info = image_input(llava_dirs["full"], None)
    assert info is not None and info.tokens_per_image == (56 // 14) ** 2 + 1  # "full" keeps the CLS position


@pytest.mark.parametrize("naming", ["transformers-4.52", "hub-clip-vision-model"])
def test_other_tensor_namings_load_the_same_model(llava_dirs, tmp_path, naming):
    """``model.language_model.*`` / ``lm_head.*`` and ``vision_tower.vision_model.*`` name the same tensors."""
    import shutil

    folder = tmp_path / naming
    shutil.copytree(llava_dirs["llama"], folder)
    tensors = load_file(str(folder / "model.safetensors"))

    def rename(k: str) -> str:
        if naming == "hub-clip-vision-model":
            return k.replace("vision_tower.", "vision_tower.vision_model.", 1)
        for old, new in (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."),
                         ("vision_tower.", "model.vision_tower."),
                         ("multi_modal_projector.", "model.multi_modal_projector.")):
            if k.startswith(old):
                return new + k[len(old):]
        return k
    save_file({rename(k): v for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"})
    a, b = load_model(llava_dirs["llama"]), load_model(folder)
    assert a.model.fingerprint() == b.model.fingerprint() and a.vision.fingerprint() == b.vision.fingerprint()


def _edit(folder: Path, name: str, edit) -> None:
    path = folder / name
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


@pytest.mark.parametrize("edit, error, pattern", [
    (lambda c: c.update(vision_feature_layer=[-2, 4]), CheckpointError,
     r"vision_feature_layer must be an integer in \[-4, 3\] \(or a list of them\) for 3 layers, got \(-2, 4\)"),
    (lambda c: c["vision_config"].update(model_type="siglip_vision_model"), UnsupportedArchitectureError,
     "only a CLIP vision tower"),
    (lambda c: c["text_config"].update(model_type="mistral"), UnsupportedArchitectureError,
     "text_config.model_type='mistral' is not supported"),
    (lambda c: c.update(image_token_index=5000), CheckpointError, r"image_token_index must be a token id in \[0, "),
    (lambda c: c.update(vision_feature_select_strategy="cls"), CheckpointError, "'default' or 'full'"),
    (lambda c: c.update(projector_hidden_act="relu"), CheckpointError, "projector_hidden_act='relu' is not supported"),
])
def test_config_it_cannot_run_is_refused_by_name(llava_dirs, tmp_path, edit, error, pattern):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(llava_dirs["llama"], folder)
    _edit(folder, "config.json", edit)
    with pytest.raises(error, match=pattern):
        load_model(folder)


@pytest.mark.parametrize("edit, pattern", [
    (lambda p: p["image_processor"].update(crop_size={"height": 64, "width": 64}), "centre-crop to the vision tower"),
    (lambda p: p["image_processor"].update(size={"height": 56, "width": 56}), "only {'shortest_edge': N}"),
    (lambda p: p["image_processor"].update(resample=1), r"processor_config.json: resample=1 \(supported: 2 "),
    (lambda p: p["image_processor"].update(image_mean=["a", 0, 0]), "image_mean must be a number or a list of 3"),
])
def test_image_processor_it_cannot_match_is_refused_by_name(llava_dirs, tmp_path, edit, pattern):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(llava_dirs["llama"], folder)
    _edit(folder, "processor_config.json", edit)
    with pytest.raises(CheckpointError, match=pattern):
        load_model(folder)


@pytest.mark.parametrize("drop, pattern", [
    ("vision_tower.encoder.layers.1.mlp.fc1.weight", "missing the vision tensor for 'vision_model.encoder.layers.1"),
    ("language_model.model.layers.1.mlp.up_proj.weight", "missing tensor 'model.layers.1.mlp.up_proj.weight'"),
])
def test_a_missing_tensor_is_named(llava_dirs, tmp_path, drop, pattern):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(llava_dirs["llama"], folder)
    tensors = load_file(str(folder / "model.safetensors"))
    del tensors[drop]
    save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=pattern):
        load_model(folder)


def test_an_extra_vision_layer_is_refused(llava_dirs, tmp_path):
    import shutil

    folder = tmp_path / "bad"
    shutil.copytree(llava_dirs["llama"], folder)
    _edit(folder, "config.json", lambda c: c["vision_config"].update(num_hidden_layers=2))
    with pytest.raises(CheckpointError, match="vision tensors that config.json does not account for"):
        load_model(folder)


def test_padding_a_thin_strip_stays_within_the_memory_bound(llava_dirs, tmp_path):
    """A 1 x 30000 strip would pad to a 900-megapixel square; it is shrunk to the budget first instead."""
    import dataclasses

    cfg = dataclasses.replace(image_input(llava_dirs["llama"], None).vision, pad_color=(0, 0, 0))
    buf = io.BytesIO()
    Image.new("RGB", (1, 30000), (200, 10, 10)).save(buf, "PNG")
    out = preprocess_image(buf.getvalue(), cfg)
    assert out.shape == (3, 56, 56) and torch.isfinite(out).all()


def test_a_config_listing_only_what_differs_from_transformers_defaults_loads_the_same(llava_dirs, tmp_path):
    """The Hub's LLaVA 1.5 configs list a sub-config's non-default keys only; the rest are transformers'."""
    import shutil

    import transformers

    folder = tmp_path / "sparse"
    shutil.copytree(llava_dirs["llama"], folder)
    dropped: list[str] = []

    def sparse(raw: dict) -> None:
        for sub, defaults in (("text_config", transformers.LlamaConfig().to_dict()),
                              ("vision_config", transformers.CLIPVisionConfig().to_dict())):
            keep = {k: v for k, v in raw[sub].items() if k == "model_type" or defaults.get(k, object()) != v}
            dropped.extend(f"{sub}.{k}" for k in raw[sub] if k not in keep)
            raw[sub] = keep
    _edit(folder, "config.json", sparse)
    assert {"text_config.rms_norm_eps", "text_config.hidden_act", "vision_config.layer_norm_eps",
            "vision_config.hidden_act"} <= set(dropped)
    full, hub = load_model(llava_dirs["llama"]), load_model(folder)
    assert hub.config == full.config and hub.vision.config == full.vision.config
    assert hub.model.fingerprint() == full.model.fingerprint() and hub.vision.fingerprint() == full.vision.fingerprint()


def test_a_sharded_llava_checkpoint_loads_the_same_model(llava_dirs, tmp_path):
    """Shards and their index (as save_pretrained writes them past max_shard_size) hold the same tensors."""
    folder = write_llava(tmp_path / "sharded", max_shard_size="40KB")
    assert (folder / "model.safetensors.index.json").exists() and len(list(folder.glob("*.safetensors"))) > 2
    whole, sharded = load_model(llava_dirs["llama"]), load_model(folder)
    assert whole.model.fingerprint() == sharded.model.fingerprint()
    assert whole.vision.fingerprint() == sharded.vision.fingerprint()


def test_an_encode_worker_loads_no_text_weights_and_a_prefill_worker_its_tower_where_asked(tmp_path: Path) -> None:
    """An encode worker's bundle holds the text model as shapes only (meta: no memory, no weights read), and
    a prefill worker, which only needs the tower's fingerprint, may keep the tower on the CPU: the
    fingerprints the embedding handshake compares stay what a full load gives."""
    folder = write_llava(tmp_path / "llava")
    full = load_model(folder)
    encode = load_model(folder, with_text=False)
    prefill = load_model(folder, vision_device="cpu")
    assert full.vision is not None and encode.vision is not None and prefill.vision is not None
    assert all(p.device.type == "meta" for p in encode.model.parameters())
    assert encode.vision.fingerprint() == prefill.vision.fingerprint() == full.vision.fingerprint()
    assert encode.config == full.config and encode.tokenizer is not None
