"""Corrupted copies of a real ``epd model init`` checkpoint: each is refused at load with a
CheckpointError that names the file and the key or tensor, never a bare Python traceback, never a
model that loads and generates garbage."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.runtime.checkpoint import INDEX_FILE
from workers.runtime.config import ModelConfig
from workers.runtime.default_model import write_default_checkpoint
from workers.runtime.errors import CheckpointError
from workers.runtime.loader import LoadedModel, load_model
from workers.runtime.tokenizer import Tokenizer

pytestmark = [pytest.mark.unit]

WEIGHTS = "model.safetensors"
UP_PROJ = "model.layers.2.mlp.up_proj.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo checkpoint, written once per module; tests only ever read it."""
    return write_default_checkpoint(tmp_path_factory.mktemp("base-ckpt"))


@pytest.fixture(scope="module")
def base_tensors(base: Path) -> dict[str, torch.Tensor]:
    return load_file(str(base / WEIGHTS))


@pytest.fixture
def ckpt(base: Path, tmp_path: Path) -> Path:
    """A copy of ``base``: small files copied, the weights and vision/ symlinked (replace, never edit)."""
    folder = tmp_path / "ckpt"
    folder.mkdir()
    for path in base.iterdir():
        if path.name in (WEIGHTS, "vision"):
            (folder / path.name).symlink_to(path)
        else:
            shutil.copy(path, folder / path.name)
    return folder


def _edit_json(folder: Path, name: str, edit: Callable[[dict[str, Any]], None]) -> None:
    path = folder / name
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


def _write_tensors(folder: Path, tensors: dict[str, torch.Tensor], name: str = WEIGHTS) -> None:
    (folder / name).unlink(missing_ok=True)  # a symlink to the base: replace it, do not write through it
    save_file(tensors, str(folder / name), metadata={"format": "pt"})


def _load(folder: Path, **kwargs: Any) -> LoadedModel:
    return load_model(folder, **{"with_vision": False, **kwargs})


def test_untouched_copy_loads(ckpt: Path) -> None:
    bundle = load_model(ckpt)  # vision/ included: its tensors are read by vision.py, not refused as unused
    assert bundle.vision is not None and bundle.config.num_layers == 4 and bundle.eos_token_ids


# ---------------------------------------------------------------- 1. non-finite weights
@pytest.mark.parametrize("value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_non_finite_weight_is_refused(ckpt: Path, base_tensors: dict[str, torch.Tensor], value: float,
                                      dtype: torch.dtype) -> None:
    tensors = {k: v.to(dtype) for k, v in base_tensors.items()}
    tensors[UP_PROJ] = tensors[UP_PROJ].clone()
    tensors[UP_PROJ][3, 5] = value
    _write_tensors(ckpt, tensors)
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{UP_PROJ}' holds 1 NaN or infinite"):
        _load(ckpt)


# ---------------------------------------------------------------- 2. rope parameters
@pytest.mark.parametrize("rope,pattern", [
    ({"rope_type": "default", "rope_theta": 0}, "rope_parameters.rope_theta must be a positive number, got 0"),
    ({"rope_type": "default", "rope_theta": -10000.0}, "rope_theta must be a positive number, got -10000.0"),
    ({"rope_type": "default", "rope_theta": float("inf")}, "rope_theta must be a positive number, got inf"),
    ({"rope_type": "default", "rope_theta": float("nan")}, "rope_theta must be a positive number, got nan"),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": 0}, "rope_parameters.factor must be a positive number"),
    ({"rope_type": "linear", "rope_theta": 1e4, "factor": -2.0}, "rope_parameters.factor must be a positive"),
    ({"rope_type": "linear", "rope_theta": 1e4}, "missing required key 'rope_parameters.factor'"),
    ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, "low_freq_factor must be a positive number"),
    ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 8192}, r"high_freq_factor \(4.0\) must be greater than"),
    ({"rope_type": "llama3", "rope_theta": 1e4, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
      "original_max_position_embeddings": 0}, "original_max_position_embeddings must be a positive integer"),
    ({"full_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 0}},
     "rope_parameters.full_attention.factor must be a positive number"),
], ids=["theta-0", "theta-negative", "theta-inf", "theta-nan", "factor-0", "factor-negative", "factor-missing",
        "llama3-low-0", "llama3-high-eq-low", "llama3-original-0", "per-layer-type-factor-0"])
def test_bad_rope_parameters_are_refused(ckpt: Path, rope: dict, pattern: str) -> None:
    _edit_json(ckpt, "config.json", lambda raw: raw.update(rope_parameters=rope))
    with pytest.raises(CheckpointError, match=pattern):
        _load(ckpt)


@pytest.mark.parametrize("overrides,pattern", [
    ({"rope_theta": 0}, "config.json: rope_theta must be a positive number, got 0"),
    ({"rope_scaling": {"type": "linear", "factor": 0}}, "rope_scaling.factor must be a positive number, got 0"),
    ({"rope_scaling": "linear"}, "rope_scaling must be an object or null, got 'linear'"),
], ids=["theta-0", "factor-0", "scaling-not-object"])
def test_bad_transformers4_rope_is_refused(ckpt: Path, overrides: dict, pattern: str) -> None:
    def edit(raw: dict) -> None:
        del raw["rope_parameters"]
        raw.update(overrides)
    _edit_json(ckpt, "config.json", edit)
    with pytest.raises(CheckpointError, match=pattern):
        _load(ckpt)


# ---------------------------------------------------------------- 3. tensors the config does not use
@pytest.mark.parametrize("layers,pattern", [
    (1, r"model\.layers\.1\.\.3\.\* are in the checkpoint but config\.json says num_hidden_layers=1"),
    (3, r"model\.layers\.3\.\* are in the checkpoint but config\.json says num_hidden_layers=3"),
], ids=["1-of-4", "3-of-4"])
def test_layers_beyond_num_hidden_layers_are_refused(ckpt: Path, layers: int, pattern: str) -> None:
    _edit_json(ckpt, "config.json", lambda raw: raw.update(num_hidden_layers=layers))
    with pytest.raises(CheckpointError, match=pattern):
        _load(ckpt)


def test_tied_config_over_distinct_lm_head_is_refused(ckpt: Path) -> None:
    _edit_json(ckpt, "config.json", lambda raw: raw.update(tie_word_embeddings=True))
    with pytest.raises(CheckpointError, match="'lm_head.weight' is in the checkpoint but config.json says "
                                              "tie_word_embeddings=true"):
        _load(ckpt)


def test_tied_config_with_identical_lm_head_loads(ckpt: Path, base_tensors: dict[str, torch.Tensor]) -> None:
    tensors = dict(base_tensors)
    tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()  # a harmless duplicate
    _write_tensors(ckpt, tensors)
    _edit_json(ckpt, "config.json", lambda raw: raw.update(tie_word_embeddings=True))
    model = _load(ckpt).model
    assert model.lm_head.weight.data_ptr() == model.embed_tokens.weight.data_ptr()
    assert torch.equal(model.embed_tokens.weight, base_tensors["model.embed_tokens.weight"])


def test_stray_tensors_are_named(ckpt: Path, base_tensors: dict[str, torch.Tensor]) -> None:
    # a Qwen2-style checkpoint labelled Llama: q/k/v biases the Llama config would silently drop
    tensors = dict(base_tensors)
    for n in range(4):
        for proj, size in (("q_proj", 512), ("k_proj", 256), ("v_proj", 256)):
            tensors[f"model.layers.{n}.self_attn.{proj}.bias"] = torch.zeros(size)
    _write_tensors(ckpt, tensors)
    with pytest.raises(CheckpointError) as info:
        _load(ckpt)
    msg = str(info.value)
    assert "does not account for" in msg and "'model.layers.0.self_attn.q_proj.bias'" in msg
    assert "(and 9 more)" in msg and "(model.safetensors)" in msg


def test_allow_listed_extras_load(ckpt: Path, base_tensors: dict[str, torch.Tensor]) -> None:
    tensors = dict(base_tensors)
    tensors.update({f"model.layers.{n}.self_attn.rotary_emb.inv_freq": torch.ones(32) for n in range(4)})
    tensors["model.vision_tower.vision_model.post_layernorm.weight"] = torch.ones(8)
    tensors["multi_modal_projector.linear_1.weight"] = torch.ones(8, 8)
    _write_tensors(ckpt, tensors)
    bundle = _load(ckpt)
    assert torch.equal(bundle.model.lm_head.weight, base_tensors["lm_head.weight"])


def test_extras_listed_in_an_index_are_refused(ckpt: Path, base_tensors: dict[str, torch.Tensor]) -> None:
    (ckpt / WEIGHTS).unlink()
    _write_tensors(ckpt, dict(base_tensors), "model-00001-of-00002.safetensors")
    _write_tensors(ckpt, {"extra.weight": torch.zeros(2)}, "model-00002-of-00002.safetensors")
    weight_map = {name: "model-00001-of-00002.safetensors" for name in base_tensors}
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": {**weight_map,
                                                              "extra.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(CheckpointError, match=r"does not account for: 'extra\.weight' \(model-00002"):
        _load(ckpt)


# ---------------------------------------------------------------- 4. config.json field types
@pytest.mark.parametrize("overrides,pattern", [
    ({"num_hidden_layers": True}, "num_hidden_layers must be a positive integer, got True"),
    ({"hidden_size": 512.7}, "hidden_size must be a positive integer, got 512.7"),
    ({"vocab_size": "803"}, "vocab_size must be a positive integer, got '803'"),
    ({"num_key_value_heads": 0}, "num_key_value_heads must be a positive integer, got 0"),
    ({"num_attention_heads": 0, "head_dim": None}, "num_attention_heads must be a positive integer, got 0"),
    ({"head_dim": 0}, "head_dim must be a positive integer, got 0"),
    ({"max_position_embeddings": -1}, "max_position_embeddings must be a positive integer, got -1"),
    ({"intermediate_size": [1536]}, r"intermediate_size must be a positive integer, got \[1536\]"),
    ({"max_position_embeddings": 2**80}, r"max_position_embeddings must be at most 2147483647 \(positions"),
    ({"rms_norm_eps": True}, "rms_norm_eps must be a positive number, got True"),
    ({"rms_norm_eps": 1e308}, r"rms_norm_eps must be in \(0, 1\), got 1e\+308"),
    ({"tie_word_embeddings": "false"}, "tie_word_embeddings must be true or false, got 'false'"),
    ({"attention_bias": 1}, "attention_bias must be true or false, got 1"),
    ({"architectures": 5}, "architectures must be a list of class names, got 5"),
    ({"architectures": "LlamaForCausalLM"}, "architectures must be a list of class names, got 'LlamaForCausalLM'"),
    ({"architectures": [None]}, r"architectures must be a list of class names, got \[None\]"),
    ({"bos_token_id": "<s>"}, "bos_token_id must be a token id, got '<s>'"),
], ids=["layers-true", "hidden-fraction", "vocab-string", "kv-heads-0", "heads-0", "head-dim-0", "positions-negative",
        "positions-2^80", "intermediate-list", "eps-bool", "eps-1e308", "tie-string", "bias-int", "architectures-int",
        "architectures-string",
        "architectures-null-entry", "bos-string"])
def test_malformed_config_fields_are_named(ckpt: Path, overrides: dict, pattern: str) -> None:
    _edit_json(ckpt, "config.json", lambda raw: raw.update(overrides))
    with pytest.raises(CheckpointError, match=pattern):
        _load(ckpt)


def test_integral_floats_read_as_integers(ckpt: Path) -> None:
    _edit_json(ckpt, "config.json", lambda raw: raw.update(hidden_size=512.0, num_hidden_layers=4.0))
    cfg = _load(ckpt).config
    assert (cfg.hidden_size, cfg.num_layers) == (512, 4) and isinstance(cfg.hidden_size, int)


# ---------------------------------------------------------------- 5. unreadable files and folders
def test_config_json_not_utf8(ckpt: Path) -> None:
    (ckpt / "config.json").write_bytes(b'{"architectures": ["Llama\xff"]}')
    with pytest.raises(CheckpointError, match=r"config\.json: is not UTF-8 text"):
        _load(ckpt)


def test_config_json_is_a_folder(ckpt: Path) -> None:
    (ckpt / "config.json").unlink()
    (ckpt / "config.json").mkdir()
    with pytest.raises(CheckpointError, match=r"config\.json: is a folder, not a file"):
        _load(ckpt)


@pytest.mark.parametrize("read", [
    lambda p: load_model(p),
    lambda p: ModelConfig.from_file(p / "config.json"),
    lambda p: Tokenizer.from_folder(p),
], ids=["load_model", "ModelConfig.from_file", "Tokenizer.from_folder"])
def test_model_path_that_is_a_file(ckpt: Path, read: Callable[[Path], object]) -> None:
    file = ckpt / "config.json"  # `--model /etc/passwd`: a file, not a folder
    with pytest.raises(CheckpointError, match=f"{file}: is not a folder"):
        read(file)


# ---------------------------------------------------------------- 6. tokenizer and generation configs
@pytest.mark.parametrize("name,content,pattern", [
    ("tokenizer_config.json", b"[1, 2]", r"tokenizer_config\.json: expected a JSON object, got list"),
    ("tokenizer_config.json", b'{"bos_token": "\xff"}', r"tokenizer_config\.json: is not UTF-8 text"),
    ("generation_config.json", b"[1]", r"generation_config\.json: expected a JSON object, got list"),
    ("generation_config.json", b'{"eos_token_id": "</s>"}',
     r"generation_config\.json: eos_token_id must be a token id or a list of token ids, got '</s>'"),
    ("generation_config.json", b'{"eos_token_id": [3, "x"]}', r"generation_config\.json: eos_token_id must be"),
    ("generation_config.json", b'{"eos_token_id": true}', r"generation_config\.json: eos_token_id must be"),
    ("generation_config.json", b'{"eos_token_id": 1.5}', r"generation_config\.json: eos_token_id must be"),
    ("generation_config.json", b'{"eos_token_id": "\xff"}', r"generation_config\.json: is not UTF-8 text"),
    ("chat_template.jinja", b"{{ messages \xff }}", r"chat_template\.jinja: is not UTF-8 text"),
], ids=["tokcfg-list", "tokcfg-not-utf8", "gen-list", "gen-eos-str", "gen-eos-list-str",
        "gen-eos-bool", "gen-eos-float", "gen-not-utf8", "jinja-not-utf8"])
def test_malformed_side_files_are_named(ckpt: Path, name: str, content: bytes, pattern: str) -> None:
    (ckpt / name).write_bytes(content)
    with pytest.raises(CheckpointError, match=pattern):
        _load(ckpt)


# ---------------------------------------------------------------- 7. the shard index
def _index(ckpt: Path, base_tensors: dict[str, torch.Tensor], shard: Any) -> None:
    (ckpt / WEIGHTS).unlink()
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": {name: shard for name in base_tensors}}))


@pytest.mark.parametrize("weight_map,pattern", [
    ({"x": 5}, "tensor 'x' maps to 5; a shard must be a file name inside the checkpoint folder"),
    (["model.safetensors"], r"weight_map must be an object of tensor name -> file name, got \['model"),
    (None, "weight_map must be an object"),
], ids=["int-value", "list", "null"])
def test_malformed_weight_map(ckpt: Path, weight_map: Any, pattern: str) -> None:
    (ckpt / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=pattern):
        _load(ckpt)


@pytest.mark.parametrize("shard", ["../outside/model.safetensors", "sub/model.safetensors", "..", "", "ABSOLUTE"],
                         ids=["parent-folder", "subfolder", "dotdot", "empty", "absolute"])
def test_shards_outside_the_folder_are_refused(ckpt: Path, base: Path, base_tensors: dict[str, torch.Tensor],
                                               shard: str) -> None:
    # every one of these names resolves to a real, valid shard: only the name check stands in the way
    for sub in (ckpt.parent / "outside", ckpt / "sub"):
        sub.mkdir()
        (sub / WEIGHTS).symlink_to(base / WEIGHTS)
    if shard == "ABSOLUTE":
        shard = str(ckpt.parent / "outside" / WEIGHTS)
    _index(ckpt, base_tensors, shard)
    with pytest.raises(CheckpointError, match=f"maps to {shard!r}; a shard must be a file name inside"):
        _load(ckpt)


def test_plainly_named_shard_loads(ckpt: Path, base: Path, base_tensors: dict[str, torch.Tensor]) -> None:
    _index(ckpt, base_tensors, "weights.safetensors")
    (ckpt / "weights.safetensors").symlink_to(base / WEIGHTS)  # as in the HF hub cache: a link into blobs/
    assert torch.equal(_load(ckpt).model.norm.weight, base_tensors["model.norm.weight"])


def test_index_not_utf8(ckpt: Path) -> None:
    (ckpt / INDEX_FILE).write_bytes(b'{"weight_map": {"\xff": "a"}}')
    with pytest.raises(CheckpointError, match=f"{INDEX_FILE}: is not UTF-8 text"):
        _load(ckpt)


# ---------------------------------------------------------------- 8. eos ids out of range
@pytest.mark.parametrize("source,eos,pattern", [
    ("config.json", 803, r"config\.json: eos_token_id 803 is out of range \(token ids must be \[0, 803\)\)"),
    ("config.json", [3, -1], r"config\.json: eos_token_id -1 is out of range"),
    ("generation_config.json", 5000, r"generation_config\.json: eos_token_id 5000 is out of range"),
    ("generation_config.json", [1, 803], r"generation_config\.json: eos_token_id 803 is out of range"),
], ids=["config-eq-vocab", "config-negative", "generation-5000", "generation-list-eq-vocab"])
def test_eos_out_of_vocab_is_refused(ckpt: Path, source: str, eos: Any, pattern: str) -> None:
    if source == "config.json":
        (ckpt / "generation_config.json").unlink()
    _edit_json(ckpt, source, lambda raw: raw.update(eos_token_id=eos))
    with pytest.raises(CheckpointError, match=pattern):
        _load(ckpt)


def test_last_token_is_a_valid_eos(ckpt: Path) -> None:
    _edit_json(ckpt, "generation_config.json", lambda raw: raw.update(eos_token_id=802))
    assert _load(ckpt).eos_token_ids == (802,)


# ---------------------------------------------------------------- 9. chat templates compile at load
BROKEN_TEMPLATE = "{% for m in messages %}{{ m['content'] }}"


def test_broken_chat_template_jinja_is_refused_at_load(ckpt: Path) -> None:
    (ckpt / "chat_template.jinja").write_text(BROKEN_TEMPLATE)
    with pytest.raises(CheckpointError, match=r"chat_template\.jinja: chat template does not compile \(line 1\)"):
        _load(ckpt)


@pytest.mark.parametrize("template", [BROKEN_TEMPLATE, [{"name": "default", "template": BROKEN_TEMPLATE}]],
                         ids=["string", "named-list"])
def test_broken_template_in_tokenizer_config_is_refused_at_load(ckpt: Path, template: Any) -> None:
    (ckpt / "chat_template.jinja").unlink()
    _edit_json(ckpt, "tokenizer_config.json", lambda raw: raw.update(chat_template=template))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: chat template does not compile"):
        Tokenizer.from_folder(ckpt)


def test_chat_template_of_the_wrong_type_is_refused(ckpt: Path) -> None:
    (ckpt / "chat_template.jinja").unlink()
    _edit_json(ckpt, "tokenizer_config.json", lambda raw: raw.update(chat_template=5))
    with pytest.raises(CheckpointError, match=r"tokenizer_config\.json: chat_template must be a string"):
        _load(ckpt)


def test_template_from_tokenizer_config_renders(ckpt: Path) -> None:
    template = (ckpt / "chat_template.jinja").read_text()
    (ckpt / "chat_template.jinja").unlink()
    _edit_json(ckpt, "tokenizer_config.json", lambda raw: raw.update(chat_template=template))
    assert Tokenizer.from_folder(ckpt).render_chat([{"role": "user", "content": "hi"}]).endswith("assistant\n")


def test_generation_blocks_compile_and_render_their_body(ckpt: Path) -> None:
    # transformers' {% generation %} tag (assistant masks): valid in HF, so it must not fail the load
    (ckpt / "chat_template.jinja").write_text(
        "{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}"
        "{% endgeneration %}{% else %}[{{ m['content'] }}]{% endif %}{% endfor %}")
    tok = Tokenizer.from_folder(ckpt)
    assert tok.render_chat([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]) == "[q]a"
