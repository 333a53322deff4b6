"""Malformed checkpoint and settings files found by mutating valid ones: each is refused with an error that
names the file and the problem (a CheckpointError or SettingsError, which the CLI prints as one line with
exit status 2), never a Python error from deeper down, a hang, or a silent load of the wrong model."""

from __future__ import annotations

import dataclasses
import json
import math
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from controlplane.settings import SettingsError
from controlplane.settings_input import check_yaml
from workers.runtime.config import ModelConfig
from workers.runtime.default_model import write_default_checkpoint
from workers.runtime.errors import CheckpointError, InvalidRequestError, UnsupportedArchitectureError
from workers.runtime.llava import image_processor
from workers.runtime.loader import load_model
from workers.runtime.tokenizer import Tokenizer
from workers.runtime.vision import load_vision
from workers.runtime.vision_config import default_vision_config

pytestmark = [pytest.mark.unit]


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_default_checkpoint(tmp_path_factory.mktemp("pristine"))


@pytest.fixture
def ckpt(pristine: Path, tmp_path: Path) -> Path:
    """A fresh copy of the built-in checkpoint (with its vision folder) to break."""
    return Path(shutil.copytree(pristine, tmp_path / "model"))


def _edit_json(path: Path, change: Callable[[dict[str, Any]], None]) -> None:
    data = json.loads(path.read_text())
    change(data)
    path.write_text(json.dumps(data))


def _load(folder: Path) -> None:
    load_model(folder, with_vision=False)


def test_an_integer_past_pythons_digit_limit_in_config_json(ckpt: Path) -> None:
    text = (ckpt / "config.json").read_text()
    (ckpt / "config.json").write_text(text.replace('"vocab_size": ', '"vocab_size": ' + "9" * 5000 + ", \"x\": "))
    with pytest.raises(CheckpointError, match=r"config\.json: not JSON epd can read \(Exceeds the limit"):
        _load(ckpt)


def test_json_nested_past_the_recursion_limit(ckpt: Path) -> None:
    (ckpt / "generation_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(CheckpointError, match=r"generation_config\.json: not JSON epd can read"):
        _load(ckpt)


def test_more_layers_than_the_checkpoint_holds_names_the_first_missing_layer(ckpt: Path) -> None:
    """Named before a shape is listed for each configured layer (10^9 layers took minutes and gigabytes)."""
    stored = json.loads((ckpt / "config.json").read_text())["num_hidden_layers"]
    _edit_json(ckpt / "config.json", lambda c: c.update(num_hidden_layers=100_000))
    with pytest.raises(CheckpointError, match=rf"missing tensors model\.layers\.{stored}\.\* \(config\.json says "
                                              rf"num_hidden_layers=100000; the checkpoint holds {stored} layers\)"):
        _load(ckpt)


@pytest.mark.parametrize("params,problem", [
    ("500000", "rope_parameters must be an object or null, got '500000'"),
    ({"full_attention": "x"}, "rope_parameters.full_attention is 'x', not an object"),
])
def test_rope_parameters_that_are_not_objects_are_refused(params: Any, problem: str) -> None:
    with pytest.raises(CheckpointError, match=problem):
        ModelConfig.from_hf_dict(_llama_dict(rope_parameters=params))


def test_empty_rope_parameters_keep_the_top_level_theta() -> None:
    assert ModelConfig.from_hf_dict(_llama_dict(rope_parameters={}, rope_theta=500000.0)).rope.theta == 500000.0
    nested = {"rope_type": "default"}  # transformers 5 without a theta of its own
    assert ModelConfig.from_hf_dict(_llama_dict(rope_parameters=nested, rope_theta=500000.0)).rope.theta == 500000.0


def test_hidden_size_not_a_multiple_of_the_heads_without_head_dim() -> None:
    with pytest.raises(CheckpointError, match=r"hidden_size \(4\) is not a multiple of num_attention_heads \(8\)"):
        ModelConfig.from_hf_dict(_llama_dict(hidden_size=4, num_attention_heads=8, num_key_value_heads=8))
    cfg = ModelConfig.from_hf_dict(_llama_dict(hidden_size=60, num_attention_heads=8, num_key_value_heads=8,
                                               head_dim=8))
    assert cfg.head_dim == 8  # with head_dim it need not divide


def test_a_llava_text_config_model_type_that_is_not_a_string() -> None:
    raw = {"architectures": ["LlavaForConditionalGeneration"], "text_config": {"model_type": ["llama"]}}
    with pytest.raises(UnsupportedArchitectureError, match=r"text_config\.model_type=\['llama'\] is not supported"):
        ModelConfig.from_hf_dict(raw)


def test_a_float8_tensor_among_the_weights(ckpt: Path) -> None:
    path = ckpt / "model.safetensors"
    tensors = load_file(path)
    name = next(k for k in tensors if k.endswith("q_proj.weight"))
    tensors[name] = tensors[name].to(torch.float8_e4m3fn)
    save_file(tensors, path)
    with pytest.raises(CheckpointError, match=rf"{name}' has dtype torch\.float8_e4m3fn; epd loads float32"):
        _load(ckpt)


def test_a_shard_that_is_a_folder(ckpt: Path) -> None:
    tensors = load_file(ckpt / "model.safetensors")
    (ckpt / "model.safetensors").unlink()
    names = sorted(tensors)
    first, second = names[: len(names) // 2], names[len(names) // 2:]
    save_file({k: tensors[k] for k in first}, ckpt / "model-00001-of-00002.safetensors")
    (ckpt / "model-00002-of-00002.safetensors").mkdir()
    weight_map = {k: "model-00001-of-00002.safetensors" for k in first}
    weight_map |= {k: "model-00002-of-00002.safetensors" for k in second}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(CheckpointError, match=r"model-00002-of-00002\.safetensors: unreadable safetensors file"):
        _load(ckpt)


def test_a_token_id_past_the_models_vocabulary(ckpt: Path) -> None:
    """The vocabulary keeps its size but one id is sparse: a count of the tokens would not see it."""
    vocab = json.loads((ckpt / "config.json").read_text())["vocab_size"]
    _edit_json(ckpt / "tokenizer.json", lambda c: c["model"]["vocab"].update(h=vocab + 4000))
    with pytest.raises(CheckpointError, match=rf"tokenizer\.json: the tokenizer produces token ids up to "
                                              rf"{vocab + 4000}, but config\.json's vocab_size is {vocab}"):
        _load(ckpt)


@pytest.mark.parametrize("template", ["{{ 1 / 0 }}", "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}"])
def test_a_chat_template_that_raises_refuses_the_request(ckpt: Path, template: str) -> None:
    (ckpt / "chat_template.jinja").write_text(template)
    tok = Tokenizer.from_folder(ckpt)
    with pytest.raises(InvalidRequestError, match="chat template rejected the messages: (ZeroDivision|Recursion)Error"):
        tok.render_chat([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize("resample", [[3], {}, True])
def test_a_resample_that_is_not_an_integer(tmp_path: Path, resample: Any) -> None:
    (tmp_path / "preprocessor_config.json").write_text(json.dumps({"resample": resample}))
    with pytest.raises(CheckpointError, match=r"resample=.* is not supported"):
        image_processor(tmp_path, 224)


@pytest.mark.parametrize("field,value", [
    ("image_mean", (math.nan,) * 3), ("image_std", (math.inf,) * 3), ("image_mean", (True, 0.5, 0.5)),
    ("layer_norm_eps", math.inf), ("rescale_factor", math.inf), ("projector_bias", "no"), ("projector_bias", 0),
])
def test_vision_constants_that_are_not_finite_numbers_or_flags(field: str, value: Any) -> None:
    with pytest.raises(CheckpointError, match=f"vision config: .*got {re.escape(repr(value))}"):
        dataclasses.replace(default_vision_config(64), **{field: value})


def test_a_vision_tensor_the_config_does_not_account_for(ckpt: Path) -> None:
    path = ckpt / "vision" / "model.safetensors"
    save_file({**load_file(path), "vision_model.some_unknown_tensor": torch.ones(7)}, path)
    with pytest.raises(CheckpointError, match="does not account for: 'vision_model.some_unknown_tensor'"):
        load_vision(ckpt)


def test_projector_biases_in_the_file_that_the_config_turns_off(ckpt: Path) -> None:
    """Refused, rather than dropped without a word."""
    _edit_json(ckpt / "vision" / "epd_vision.json", lambda c: c.update(multimodal_projector_bias=False))
    with pytest.raises(CheckpointError, match=r"projector\.safetensors: holds tensors .* 'multi_modal_projector\."
                                              r"linear_\d\.bias'"):
        load_vision(ckpt)


def test_a_settings_file_that_is_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "epd.yaml"
    path.write_bytes(b"port: \xff\xfe\n")
    with pytest.raises(SettingsError, match=r"epd\.yaml is not UTF-8 text \(invalid start byte at byte 6\)"):
        check_yaml(path)


def _llama_dict(**overrides: Any) -> dict[str, Any]:
    return {"architectures": ["LlamaForCausalLM"], "vocab_size": 64, "hidden_size": 32, "intermediate_size": 64,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, **overrides}
