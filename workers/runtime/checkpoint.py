"""Decoder weights <-> Hugging Face safetensors checkpoints.

HF names (``model.layers.3.self_attn.q_proj.weight``) map onto the engine's fused parameters
(``layers.3.qkv_proj.weight``). Reading checks every tensor's presence, shape, dtype and finiteness
before copying, refuses tensors the config does not account for, and names the tensor and file in
any error.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from workers.runtime.config import ModelConfig, read_json_object
from workers.runtime.errors import CheckpointError
from workers.runtime.model import DecoderLayer, DecoderModel

INDEX_FILE = "model.safetensors.index.json"
# Tensors a real checkpoint may carry beside the decoder's, which the engine may leave unread. Anything
# else that the config does not account for is refused: it means the config and the weights disagree
# (num_hidden_layers too small, tie_word_embeddings over a distinct lm_head, a Qwen2 checkpoint labelled
# Llama whose q/k/v biases would be dropped), and the model would run, wrongly.
# - rotary_emb.inv_freq / cos_cached / sin_cached: RoPE buffers older Llama checkpoints saved; the engine
#   recomputes them from config.json.
# - vision_tower.*, vision_model.*, multi_modal_projector.* (optionally under model.): a multimodal
#   checkpoint's image side. The engine reads its vision tower from the vision/ subfolder (vision.py),
#   whose files are never in this folder's weight map, so these are someone else's to load.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq", "rotary_emb.cos_cached", "rotary_emb.sin_cached")
_IGNORED_PREFIXES = tuple(f"{outer}{inner}." for outer in ("", "model.")
                          for inner in ("vision_tower", "vision_model", "multi_modal_projector"))
_LAYER = re.compile(r"model\.layers\.(\d+)\.")
# A stored tensor name -> the decoder's HF name (``model.layers.0...``, ``lm_head.weight``), or None for a
# tensor that belongs to another part of the checkpoint (LLaVA's vision tower). Identity when absent.
Rename = Callable[[str], "str | None"]


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


def weight_map(folder: Path) -> dict[str, Path]:
    """Stored tensor name -> the safetensors file that holds it."""
    index = folder / INDEX_FILE
    if index.exists():
        weight_map = read_json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise CheckpointError(f"{index}: malformed index (weight_map must be an object of tensor name -> "
                                  f"file name, got {weight_map!r:.80})")
        files: dict[str, Path] = {}
        for name, fname in weight_map.items():
            # A shard is a plain file name in this folder: "../other/model.safetensors" or an absolute path
            # would load weights from outside the checkpoint. (Symlinked shards, as in the HF hub cache,
            # are fine: the name is checked, not where the link points.)
            if (not isinstance(fname, str) or not fname or fname in (".", "..") or "/" in fname
                    or "\\" in fname or Path(fname).is_absolute()):
                raise CheckpointError(f"{index}: malformed index (tensor {name!r} maps to {fname!r}; a shard must "
                                      "be a file name inside the checkpoint folder)")
            files[name] = folder / fname
        for path in sorted(set(files.values())):
            if not path.exists():
                raise CheckpointError(f"{index}: lists shard {path.name}, which is missing")
        return files
    shards = sorted(folder.glob("*.safetensors"))
    if not shards:
        raise CheckpointError(f"{folder}: no *.safetensors weights found")
    files = {}
    for path in shards:
        for name in _keys(path):
            if name in files:
                raise CheckpointError(f"tensor {name!r} appears in both {files[name].name} and {path.name}")
            files[name] = path
    return files


def _is_ignorable(name: str) -> bool:
    return name.endswith(_IGNORED_SUFFIXES) or name.startswith(_IGNORED_PREFIXES)


def _check_no_unused(folder: Path, files: dict[str, Path], expected: dict[str, tuple[int, ...]],
                     cfg: ModelConfig) -> None:
    """Refuse tensors that neither the config nor the allow-list above accounts for."""
    unused = [n for n in files if n not in expected and not _is_ignorable(n)]
    if cfg.tie_word_embeddings and "lm_head.weight" in unused:
        unused.remove("lm_head.weight")  # read_hf_tensors accepts it when it equals the embeddings
    if not unused:
        return
    layer_ids = (int(m.group(1)) for m in map(_LAYER.match, unused) if m)
    extra_layers = sorted({n for n in layer_ids if n >= cfg.num_layers})
    if extra_layers:
        lo, hi = extra_layers[0], extra_layers[-1]
        span = f"model.layers.{lo}.*" if lo == hi else f"model.layers.{lo}..{hi}.*"
        raise CheckpointError(f"{folder}: {span} are in the checkpoint but config.json says "
                              f"num_hidden_layers={cfg.num_layers}")
    shown = ", ".join(repr(n) for n in unused[:3])
    more = f" (and {len(unused) - 3} more)" if len(unused) > 3 else ""
    raise CheckpointError(f"{folder}: the checkpoint holds tensors that config.json does not account for: "
                          f"{shown}{more} ({files[unused[0]].name})")


def _keys(path: Path) -> list[str]:
    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as exc:
        raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None


def renamed(files: dict[str, Path], rename: Rename | None) -> tuple[dict[str, Path], dict[str, str]]:
    """``files`` under the names ``rename`` gives (dropping None), and each new name's stored name."""
    if rename is None:
        return files, {n: n for n in files}
    out: dict[str, Path] = {}
    stored: dict[str, str] = {}
    for key, path in files.items():
        name = rename(key)
        if name is None:
            continue
        if name in out:
            raise CheckpointError(f"tensors {stored[name]!r} ({out[name].name}) and {key!r} ({path.name}) are "
                                  f"both {name!r}")
        out[name], stored[name] = path, key
    return out, stored


def read_hf_tensors(folder: Path, cfg: ModelConfig, rename: Rename | None = None) -> dict[str, torch.Tensor]:
    """Load and check every tensor the config requires; refuse tensors it does not account for. ``rename``
    maps the stored names onto the decoder's HF names (a LLaVA checkpoint's ``language_model.model.*``)."""
    files, stored = renamed(weight_map(folder), rename)
    layers = {int(m.group(1)) for m in map(_LAYER.match, files) if m}
    # a whole layer missing (num_hidden_layers past the stored layers) is named before the expected names,
    # which are listed layer by layer, are built
    absent = next((n for n in range(cfg.num_layers) if n not in layers), cfg.num_layers)
    if absent < cfg.num_layers:
        raise CheckpointError(f"{folder}: checkpoint is missing tensors model.layers.{absent}.* (config.json says "
                              f"num_hidden_layers={cfg.num_layers}; the checkpoint holds {len(layers)} layers)")
    expected = hf_tensor_shapes(cfg)
    missing = [n for n in expected if n not in files]
    if missing:
        more = f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""
        raise CheckpointError(f"{folder}: checkpoint is missing tensor {missing[0]!r}{more}")
    _check_no_unused(folder, files, expected, cfg)
    wanted = dict(expected)
    if cfg.tie_word_embeddings and "lm_head.weight" in files:
        wanted["lm_head.weight"] = expected["model.embed_tokens.weight"]  # checked against it below
    by_file: dict[Path, list[str]] = {}
    for name in wanted:
        by_file.setdefault(files[name], []).append(name)
    tensors: dict[str, torch.Tensor] = {}
    for path, names in by_file.items():
        try:
            with safe_open(str(path), framework="pt") as f:
                for name in names:
                    key = stored[name]
                    t = f.get_tensor(key)
                    check_tensor(t, key, wanted[name], path.name)
                    tensors[name] = t
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{path}: unreadable safetensors file ({exc})") from None
    head = tensors.pop("lm_head.weight", None)
    if head is not None and not cfg.tie_word_embeddings:
        tensors["lm_head.weight"] = head
    elif head is not None and not torch.equal(head, tensors["model.embed_tokens.weight"]):
        raise CheckpointError(f"{files['lm_head.weight'].name}: tensor 'lm_head.weight' is in the checkpoint "
                              "but config.json says tie_word_embeddings=true, which would use "
                              "model.embed_tokens.weight (a different tensor) in its place")
    return tensors


LOADABLE_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def check_tensor(t: torch.Tensor, name: str, shape: tuple[int, ...], where: str) -> None:
    """CheckpointError naming the tensor and file unless ``t`` has ``shape``, a dtype epd loads
    (``LOADABLE_DTYPES``) and only finite values."""
    if tuple(t.shape) != shape:
        raise CheckpointError(f"{where}: tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    if t.dtype not in LOADABLE_DTYPES:
        raise CheckpointError(f"{where}: tensor {name!r} has dtype {t.dtype}; epd loads float32, bfloat16, float16 "
                              f"and float64 weights (not integer or quantised ones)")
    check_finite(t, name, where)


def check_finite(t: torch.Tensor, name: str, where: str) -> None:
    """CheckpointError naming the tensor and file when ``t`` holds a NaN or an infinity."""
    if not _all_finite(t):
        bad = int((~torch.isfinite(t.float())).sum())
        raise CheckpointError(f"{where}: tensor {name!r} holds {bad} NaN or infinite value{'s' if bad > 1 else ''}")


def _all_finite(t: torch.Tensor) -> bool:
    """No NaN or +-Inf. aminmax propagates NaN and reads the tensor once without a mask the size of
    the tensor (isfinite().all() allocates one, and is the slower of the two on CPU)."""
    try:
        lo, hi = torch.aminmax(t)
    except (RuntimeError, NotImplementedError):  # dtypes without aminmax (float8 on CPU)
        return bool(torch.isfinite(t.float()).all())
    return bool(torch.isfinite(lo) and torch.isfinite(hi))


@torch.inference_mode()
def load_into(model: DecoderModel, tensors: dict[str, torch.Tensor]) -> None:
    """Copy HF-named tensors into the model's (fused) parameters, casting to the model dtype."""
    cfg = model.cfg
    model.embed_tokens.weight.copy_(tensors["model.embed_tokens.weight"])
    model.norm.weight.copy_(tensors["model.norm.weight"])
    if not cfg.tie_word_embeddings:
        model.lm_head.weight.copy_(tensors["lm_head.weight"])
    for n, layer in enumerate(_layers(model)):
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


def _layers(model: DecoderModel) -> list[DecoderLayer]:
    return [layer for layer in model.layers if isinstance(layer, DecoderLayer)]


def model_to_hf_tensors(model: DecoderModel) -> dict[str, torch.Tensor]:
    """The inverse of ``load_into``: HF-named, unfused, contiguous tensors."""
    cfg = model.cfg
    out = {"model.embed_tokens.weight": model.embed_tokens.weight, "model.norm.weight": model.norm.weight}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = model.lm_head.weight
    for n, layer in enumerate(_layers(model)):
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


def _umask() -> int:
    """The process's umask, read without changing it (Linux); 0o022 where it cannot be read."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except OSError:
        pass
    return 0o022


def save_weights(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """``safetensors.torch.save_file``, leaving the file as readable as any other file this process writes:
    safetensors 0.8 writes through a private temporary file (mode 0600), which another user serving the
    folder (a container, a service account) could not read."""
    save_file(tensors, str(path), metadata={"format": "pt"})
    os.chmod(path, 0o666 & ~_umask())


def save_hf_weights(model: DecoderModel, folder: Path, max_shard_bytes: int | None = None) -> None:
    """Write model weights as ``model.safetensors`` or, past ``max_shard_bytes``, as indexed shards."""
    tensors = model_to_hf_tensors(model)
    folder.mkdir(parents=True, exist_ok=True)
    if max_shard_bytes is None:
        save_weights(tensors, folder / "model.safetensors")
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
        save_weights(shard, folder / fname)
        weight_map.update({name: fname for name in shard})
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (folder / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                                indent=2))
