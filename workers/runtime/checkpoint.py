"""Decoder weights <-> Hugging Face safetensors checkpoints.

HF names (``model.layers.3.self_attn.q_proj.weight``) map onto the engine's fused parameters
(``layers.3.qkv_proj.weight``). Reading checks every tensor's presence and shape before copying,
and names the tensor and file in any error.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from workers.runtime.config import ModelConfig
from workers.runtime.errors import CheckpointError
from workers.runtime.model import DecoderModel

INDEX_FILE = "model.safetensors.index.json"
# Tensors some checkpoints carry that the engine recomputes or does not need.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def hf_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of this config must hold, with its shape."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    if not cfg.tie_word_embeddings:
        shapes["lm_head.weight"] = (cfg.vocab_size, h)
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes[p + "input_layernorm.weight"] = (h,)
        shapes[p + "post_attention_layernorm.weight"] = (h,)
        for proj, out in (("q_proj", cfg.q_size), ("k_proj", cfg.kv_size), ("v_proj", cfg.kv_size)):
            shapes[f"{p}self_attn.{proj}.weight"] = (out, h)
            if cfg.qkv_bias:
                shapes[f"{p}self_attn.{proj}.bias"] = (out,)
        shapes[p + "self_attn.o_proj.weight"] = (h, cfg.q_size)
        if cfg.o_bias:
            shapes[p + "self_attn.o_proj.bias"] = (h,)
        for proj, shape in (("gate_proj", (i, h)), ("up_proj", (i, h)), ("down_proj", (h, i))):
            shapes[f"{p}mlp.{proj}.weight"] = shape
            if cfg.mlp_bias:
                shapes[f"{p}mlp.{proj}.bias"] = (shape[0],)
    return shapes


def _weight_map(folder: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file that holds it."""
    index = folder / INDEX_FILE
    if index.exists():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise CheckpointError(f"{index}: malformed index ({exc})") from None
        files = {name: folder / fname for name, fname in weight_map.items()}
        for path in set(files.values()):
            if not path.exists():
                raise CheckpointError(f"{index}: lists shard {path.name}, which is missing")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    files: dict[str, Path] = {}
    for path in shards:
        for name in _keys(path):
            if name in files:
                raise CheckpointError(f"tensor {name!r} appears in both {files[name].name} and {path.name}")
            files[name] = path
    return files


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None


def read_hf_tensors(folder: Path, cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Load and shape-check every tensor the config requires. Extra tensors are ignored."""
    expected = hf_tensor_shapes(cfg)
    files = _weight_map(folder)
    missing = [n for n in expected if n not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder}: checkpoint is missing tensor {missing[0]!r}{more}")
    by_file: dict[Path, list[str]] = {}
    for name in expected:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    t = f.get_tensor(name)
                    if tuple(t.shape) != expected[name]:
                        raise CheckpointError(
                            f"{path.name}: tensor {name!r} has shape {tuple(t.shape)}, expected {expected[name]}")
                    if not t.is_floating_point():
                        raise CheckpointError(f"{path.name}: tensor {name!r} has non-float dtype {t.dtype}")
                    tensors[name] = t
        except SafetensorError as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None
    return tensors


@torch.inference_mode()
def load_into(model: DecoderModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into the model's (fused) parameters, casting to the model dtype."""
    cfg = model.cfg
    model.embed_tokens.weight.copy_(tensors["model.embed_tokens.weight"])
    model.norm.weight.copy_(tensors["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        model.lm_head.weight.copy_(tensors["lm_head.weight"])
    for n, layer in enumerate(model.layers):
        p = f"model.layers.{n}."
        layer.input_layernorm.weight.copy_(tensors[p + "input_layernorm.weight"])
        layer.post_attention_layernorm.weight.copy_(tensors[p + "post_attention_layernorm.weight"])
        for fused, parts in ((layer.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj")),
                             (layer.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj")),
                             (layer.o_proj, ("self_attn.o_proj",)),
                             (layer.down_proj, ("mlp.down_proj",))):
            fused.weight.copy_(torch.cat([tensors[f"{p}{part}.weight"] for part in parts]))
            if fused.bias is not None:
                fused.bias.copy_(torch.cat([tensors[f"{p}{part}.bias"] for part in parts]))


def model_to_hf_tensors(model: DecoderModel) -> dict[str, torch.Tensor]:
    """The inverse of ``load_into``: HF-named, unfused, contiguous tensors."""
    cfg = model.cfg
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for n, layer in enumerate(model.layers):
        p = f"model.layers.{n}."
        out[p + "input_layernorm.weight"] = layer.input_layernorm.weight
        out[p + "post_attention_layernorm.weight"] = layer.post_attention_layernorm.weight
        for fused, parts, sizes in (
                (layer.qkv_proj, ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 (cfg.q_size, cfg.kv_size, cfg.kv_size)),
                (layer.gate_up_proj, ("mlp.gate_proj", "mlp.up_proj"), (cfg.intermediate_size,) * 2),
                (layer.o_proj, ("self_attn.o_proj",), (cfg.hidden_size,)),
                (layer.down_proj, ("mlp.down_proj",), (cfg.hidden_size,))):
            for part, w in zip(parts, fused.weight.split(sizes)):
                out[f"{p}{part}.weight"] = w
            if fused.bias is not None:
                for part, b in zip(parts, fused.bias.split(sizes)):
                    out[f"{p}{part}.bias"] = b
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def save_hf_weights(model: DecoderModel, folder: Path, max_shard_bytes: int | None = None) -> None:
    """Write model weights as ``model.safetensors`` or, past ``max_shard_bytes``, as indexed shards."""
    tensors = model_to_hf_tensors(model)
    folder.mkdir(parents=True, exist_ok=True)
    meta = {"format": "pt"}
    if max_shard_bytes is None:
        save_file(tensors, str(folder / "model.safetensors"), metadata=meta)
        return
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += nbytes
    weight_map = {}
    for i, shard in enumerate(shards):
        fname = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata=meta)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
