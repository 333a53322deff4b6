"""HF checkpoint folders -> DecoderModel: values match transformers; every bad input names its problem."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from workers.runtime.checkpoint import INDEX_FILE
from workers.runtime.config import ModelConfig, RopeConfig
from workers.runtime.errors import CheckpointError, UnsupportedArchitectureError
from workers.runtime.loader import LoadedModel, load_model
from workers.runtime.model import DecoderLayer

pytestmark = [pytest.mark.unit]

K_PROJ = "model.layers.1.self_attn.k_proj.weight"


def _load(folder: Path, dtype: torch.dtype = torch.float32) -> LoadedModel:
    return load_model(folder, dtype=dtype, require_tokenizer=False, with_vision=False)


def _hf_state(folder: Path) -> dict[str, torch.Tensor]:
    """The parameters as transformers itself reads them back (the independent oracle)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_matches_hf(bundle: LoadedModel, hf: dict[str, torch.Tensor], dtype: torch.dtype = torch.float32) -> None:
    cfg, model = bundle.config, bundle.model

    def same(ours: torch.Tensor, theirs: torch.Tensor) -> None:
        assert ours.dtype == dtype
        assert torch.equal(ours, theirs.to(dtype))

    same(model.embed_tokens.weight, hf["model.embed_tokens.weight"])
    same(model.norm.weight, hf["model.norm.weight"])
    same(model.lm_head.weight, hf["lm_head.weight"])
    for n, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        p = f"model.layers.{n}."
        q, k, v = layer.qkv_proj.weight.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
        same(q, hf[p + "self_attn.q_proj.weight"])
        same(k, hf[p + "self_attn.k_proj.weight"])
        same(v, hf[p + "self_attn.v_proj.weight"])
        if cfg.qkv_bias:
            qb, kb, vb = layer.qkv_proj.bias.split([cfg.q_size, cfg.kv_size, cfg.kv_size])
            same(qb, hf[p + "self_attn.q_proj.bias"])
            same(kb, hf[p + "self_attn.k_proj.bias"])
            same(vb, hf[p + "self_attn.v_proj.bias"])
        else:
            assert layer.qkv_proj.bias is None
        gate, up = layer.gate_up_proj.weight.chunk(2)
        same(gate, hf[p + "mlp.gate_proj.weight"])
        same(up, hf[p + "mlp.up_proj.weight"])
        same(layer.o_proj.weight, hf[p + "self_attn.o_proj.weight"])
        same(layer.down_proj.weight, hf[p + "mlp.down_proj.weight"])
        same(layer.input_layernorm.weight, hf[p + "input_layernorm.weight"])
        same(layer.post_attention_layernorm.weight, hf[p + "post_attention_layernorm.weight"])


def _rewrite(folder: Path, edit) -> None:
    """Apply ``edit`` to the tensors of a single-file checkpoint and write them back."""
    path = folder / "model.safetensors"
    tensors = load_file(str(path))
    edit(tensors)
    save_file(tensors, str(path), metadata={"format": "pt"})


def _edit_config(folder: Path, edit) -> None:
    path = folder / "config.json"
    raw = json.loads(path.read_text())
    edit(raw)
    path.write_text(json.dumps(raw))


# ---------------------------------------------------------------- loading what transformers wrote
@pytest.mark.transformers
@pytest.mark.parametrize("arch,tie", [("llama", False), ("llama", True), ("qwen2", False)])
def test_load_matches_transformers(tiny_llama_dir, arch: str, tie: bool) -> None:
    folder = tiny_llama_dir(arch, tie=tie)
    bundle = _load(folder)
    cfg = bundle.config
    assert cfg.architecture == {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}[arch]
    assert (cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.num_layers) == (4, 2, 8, 2)
    assert cfg.tie_word_embeddings is tie
    assert cfg.qkv_bias is (arch == "qwen2")
    assert not cfg.o_bias and not cfg.mlp_bias
    if tie:
        assert bundle.model.lm_head.weight.data_ptr() == bundle.model.embed_tokens.weight.data_ptr()
        assert "lm_head.weight" not in load_file(str(folder / "model.safetensors"))
    else:
        assert not torch.equal(bundle.model.lm_head.weight, bundle.model.embed_tokens.weight)
    _assert_matches_hf(bundle, _hf_state(folder))


@pytest.mark.transformers
def test_qwen2_biases_are_loaded_not_zero(tiny_llama_dir) -> None:
    bundle = _load(tiny_llama_dir("qwen2"))
    bias = bundle.model.layers[0].qkv_proj.bias
    assert bias is not None and bias.shape == (bundle.config.q_size + 2 * bundle.config.kv_size,)
    assert bias.abs().min() > 0  # the fixture draws every parameter, so no zero-fill passes


@pytest.mark.transformers
def test_sharded_checkpoint_uses_index(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama", max_shard_size="200KB", vocab_size=512, hidden_size=64,
                            intermediate_size=128, num_attention_heads=8, num_key_value_heads=2)
    index = json.loads((folder / INDEX_FILE).read_text())
    shards = set(index["weight_map"].values())
    assert len(shards) >= 2 and not (folder / "model.safetensors").exists()
    bundle = _load(folder)
    assert (bundle.config.num_heads, bundle.config.num_kv_heads) == (8, 2)
    _assert_matches_hf(bundle, _hf_state(folder))


@pytest.mark.transformers
def test_load_casts_to_requested_dtype(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("qwen2")
    _assert_matches_hf(_load(folder, torch.bfloat16), _hf_state(folder), torch.bfloat16)


@pytest.mark.transformers
def test_eos_comes_from_generation_config(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama")
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert _load(folder).eos_token_ids == (2, 7)
    (folder / "generation_config.json").unlink()
    _edit_config(folder, lambda raw: raw.update(eos_token_id=5))
    assert _load(folder).eos_token_ids == (5,)


# ---------------------------------------------------------------- bad tensors and files
@pytest.mark.transformers
def test_missing_tensor_is_named(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama")
    _rewrite(folder, lambda t: t.pop(K_PROJ))
    with pytest.raises(CheckpointError, match=f"missing tensor '{K_PROJ}'"):
        _load(folder)


@pytest.mark.transformers
def test_untied_checkpoint_without_lm_head_is_refused(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama", tie=True)  # no lm_head.weight on disk
    _edit_config(folder, lambda raw: raw.update(tie_word_embeddings=False))
    with pytest.raises(CheckpointError, match="missing tensor 'lm_head.weight'"):
        _load(folder)


@pytest.mark.transformers
def test_tensor_missing_from_index_is_named(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama", max_shard_size="20KB")
    path = folder / INDEX_FILE
    index = json.loads(path.read_text())
    del index["weight_map"][K_PROJ]
    path.write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=f"missing tensor '{K_PROJ}'"):
        _load(folder)


@pytest.mark.transformers
def test_wrong_shape_names_tensor_and_both_shapes(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama")
    _rewrite(folder, lambda t: t.update({K_PROJ: torch.zeros(8, 32)}))  # expected (16, 32): 2 kv heads x 8
    with pytest.raises(CheckpointError) as info:
        _load(folder)
    msg = str(info.value)
    assert K_PROJ in msg and "[8, 32]" in msg and "[16, 32]" in msg


@pytest.mark.transformers
def test_integer_tensor_is_refused(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama")
    _rewrite(folder, lambda t: t.update({"model.norm.weight": torch.ones(32, dtype=torch.int32)}))
    with pytest.raises(CheckpointError, match="'model.norm.weight' has dtype torch.int"):
        _load(folder)


@pytest.mark.transformers
def test_index_listing_missing_shard(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama", max_shard_size="20KB")
    shard = json.loads((folder / INDEX_FILE).read_text())["weight_map"][K_PROJ]
    (folder / shard).unlink()
    with pytest.raises(CheckpointError, match=f"lists shard {shard}, which is missing"):
        _load(folder)


@pytest.mark.transformers
def test_malformed_index(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama", max_shard_size="20KB")
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {}}))
    with pytest.raises(CheckpointError, match="malformed index"):
        _load(folder)


@pytest.mark.transformers
@pytest.mark.parametrize("damage", ["truncated", "garbage", "empty"])
def test_unreadable_safetensors(tiny_llama_dir, damage: str) -> None:
    folder = tiny_llama_dir("llama")
    path = folder / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes({"truncated": data[: len(data) // 2], "garbage": os.urandom(4096), "empty": b""}[damage])
    with pytest.raises(CheckpointError, match="model.safetensors: unreadable safetensors file"):
        _load(folder)


@pytest.mark.transformers
def test_truncated_shard_behind_index(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama", max_shard_size="20KB")
    shard = folder / json.loads((folder / INDEX_FILE).read_text())["weight_map"][K_PROJ]
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match=f"{shard.name}: unreadable safetensors file"):
        _load(folder)


@pytest.mark.transformers
def test_no_weights_at_all(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama")
    (folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights found"):
        _load(folder)


@pytest.mark.transformers
def test_tokenizer_required_by_default(tiny_llama_dir) -> None:
    with pytest.raises(CheckpointError, match="tokenizer.json not found"):
        load_model(tiny_llama_dir("llama"), with_vision=False)


def test_not_a_folder(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a checkpoint folder"):
        load_model(tmp_path / "nope")


# ---------------------------------------------------------------- config.json
def _config_dict(**overrides) -> dict:
    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128)
    return {**cfg.to_hf_dict(), **overrides}


@pytest.mark.transformers
def test_unsupported_architecture_lists_supported(tiny_llama_dir) -> None:
    folder = tiny_llama_dir("llama")
    _edit_config(folder, lambda raw: raw.update(architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(UnsupportedArchitectureError) as info:
        _load(folder)
    msg = str(info.value)
    assert "GPT2LMHeadModel" in msg and "LlamaForCausalLM" in msg and "Qwen2ForCausalLM" in msg


def test_model_type_fallback_when_architectures_absent() -> None:
    raw = _config_dict(model_type="qwen2")
    del raw["architectures"]
    cfg = ModelConfig.from_hf_dict(raw)
    assert cfg.architecture == "Qwen2ForCausalLM" and cfg.qkv_bias


def test_missing_config_json(tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match=r"config.json: file not found"):
        load_model(tmp_path)


def test_invalid_json_config(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text('{"architectures": ["LlamaForCausalLM"],')
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_model(tmp_path)


def test_config_not_an_object(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match="expected a JSON object"):
        load_model(tmp_path)


@pytest.mark.parametrize("key", ["vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                                 "num_attention_heads"])
def test_missing_config_key_is_named(tmp_path: Path, key: str) -> None:
    raw = _config_dict()
    del raw[key]
    (tmp_path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(CheckpointError, match=f"missing required key '{key}'"):
        load_model(tmp_path)


@pytest.mark.parametrize("overrides,pattern", [
    ({"num_attention_heads": 4, "num_key_value_heads": 3}, "must be a multiple of"),
    ({"hidden_size": 0}, "hidden_size must be a positive integer"),
    ({"head_dim": 7}, "head_dim must be even"),
    ({"vocab_size": "many"}, "vocab_size must be a positive integer, got 'many'"),
])
def test_invalid_config_values(overrides: dict, pattern: str) -> None:
    with pytest.raises(CheckpointError, match=pattern):
        ModelConfig.from_hf_dict(_config_dict(**overrides))


@pytest.mark.parametrize("overrides,pattern", [
    ({"hidden_act": "gelu"}, "hidden_act 'gelu' is not supported"),
    ({"use_sliding_window": True}, "sliding-window"),
])
def test_unsupported_features(overrides: dict, pattern: str) -> None:
    with pytest.raises(UnsupportedArchitectureError, match=pattern):
        ModelConfig.from_hf_dict(_config_dict(**overrides))


@pytest.mark.parametrize("style", ["v5", "v4"])
def test_unsupported_rope_type(style: str) -> None:
    rope = {"rope_type": "yarn", "factor": 4.0}
    raw = (_config_dict(rope_parameters={**rope, "rope_theta": 10000.0}) if style == "v5"
           else _config_dict(rope_parameters=None, rope_scaling=rope))
    with pytest.raises(UnsupportedArchitectureError) as info:
        ModelConfig.from_hf_dict(raw)
    msg = str(info.value)
    assert "'yarn'" in msg and "default" in msg and "linear" in msg and "llama3" in msg


LLAMA3_ROPE = {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("type_key", ["type", "rope_type"])
def test_transformers4_rope_matches_transformers5(type_key: str) -> None:
    v5 = _config_dict(rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, **LLAMA3_ROPE},
                      rope_theta=None, rope_scaling=None)
    v4 = _config_dict(rope_theta=500000.0, rope_scaling={type_key: "llama3", **LLAMA3_ROPE})
    del v4["rope_parameters"]
    expected = RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                          high_freq_factor=4.0, original_max_position_embeddings=8192)
    assert ModelConfig.from_hf_dict(v5).rope == expected
    assert ModelConfig.from_hf_dict(v4) == ModelConfig.from_hf_dict(v5)


def test_transformers4_default_rope_reads_rope_theta() -> None:
    raw = _config_dict(rope_theta=123456.0, rope_scaling=None)
    del raw["rope_parameters"]
    assert ModelConfig.from_hf_dict(raw).rope == RopeConfig(theta=123456.0)


def test_transformers5_per_layer_type_rope_parameters() -> None:
    raw = _config_dict(rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0,
                                                           "rope_theta": 1e6}})
    assert ModelConfig.from_hf_dict(raw).rope == RopeConfig(theta=1e6, rope_type="linear", factor=2.0)


@pytest.mark.parametrize("cfg", [
    ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=64,
                num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128),
    ModelConfig(architecture="LlamaForCausalLM", vocab_size=1000, hidden_size=64, intermediate_size=96,
                num_layers=3, num_heads=8, num_kv_heads=8, head_dim=16, max_position_embeddings=4096,
                rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0,
                                                   low_freq_factor=2.0, high_freq_factor=8.0,
                                                   original_max_position_embeddings=1024),
                tie_word_embeddings=True, qkv_bias=True, o_bias=True, mlp_bias=True, bos_token_id=1,
                eos_token_ids=(2, 3)),
    ModelConfig(architecture="Qwen2ForCausalLM", vocab_size=500, hidden_size=48, intermediate_size=80,
                num_layers=1, num_heads=6, num_kv_heads=2, head_dim=12, max_position_embeddings=512,
                rope=RopeConfig(theta=1e6, rope_type="linear", factor=4.0), qkv_bias=True, bos_token_id=None,
                eos_token_ids=(7,)),
], ids=["llama-default", "llama3-rope-biases", "qwen2-linear"])
def test_to_hf_dict_round_trips(cfg: ModelConfig) -> None:
    raw = cfg.to_hf_dict()
    assert ModelConfig.from_hf_dict(json.loads(json.dumps(raw))) == cfg
    # the 4.x keys written alongside describe the same rope
    del raw["rope_parameters"]
    assert ModelConfig.from_hf_dict(raw) == cfg


@pytest.mark.transformers
def test_to_hf_dict_is_read_by_transformers() -> None:
    from transformers import LlamaConfig

    cfg = ModelConfig(architecture="LlamaForCausalLM", vocab_size=96, hidden_size=32, intermediate_size=64,
                      num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8, max_position_embeddings=128,
                      rope=RopeConfig(theta=500000.0, rope_type="llama3", factor=8.0, low_freq_factor=1.0,
                                      high_freq_factor=4.0, original_max_position_embeddings=64))
    hf = LlamaConfig(**cfg.to_hf_dict())
    assert (hf.num_key_value_heads, hf.head_dim, hf.num_hidden_layers) == (2, 8, 2)
    assert hf.rope_parameters["rope_type"] == "llama3" and hf.rope_parameters["factor"] == 8.0
    assert ModelConfig.from_hf_dict(hf.to_dict()) == cfg
