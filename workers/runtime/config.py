"""ModelConfig: the decoder's shape, parsed and validated from a Hugging Face ``config.json``.

Both config dialects are read: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). Anything the engine cannot run is refused here, with a message that says
what is supported, so a bad checkpoint fails at load time rather than mid-request.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from workers.runtime.errors import CheckpointError, UnsupportedArchitectureError

# architecture name in config.json -> whether q/k/v projections carry a bias by design
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")

RopeType = Literal["default", "linear", "llama3"]


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters. ``factor`` etc. only apply to scaled rope types."""

    theta: float = 10000.0
    rope_type: RopeType = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about its own shape."""

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    rms_norm_eps: float = 1e-6
    rope: RopeConfig = field(default_factory=RopeConfig)
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise CheckpointError(f"config.json: {name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if not self.rms_norm_eps > 0:
            raise CheckpointError(f"config.json: rms_norm_eps must be positive, got {self.rms_norm_eps!r}")

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def model_type(self) -> str:
        return SUPPORTED_ARCHITECTURES[self.architecture]

    def fingerprint_fields(self) -> dict[str, Any]:
        """The fields that fix the KV layout; the transfer handshake compares them."""
        return {"architecture": self.architecture, "num_layers": self.num_layers,
                "num_kv_heads": self.num_kv_heads, "head_dim": self.head_dim,
                "hidden_size": self.hidden_size, "vocab_size": self.vocab_size}

    # ------------------------------------------------------------------ parsing
    @classmethod
    def from_hf_dict(cls, raw: dict[str, Any]) -> "ModelConfig":
        archs = raw.get("architectures") or []
        arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
        if arch is None:
            # Fall back on model_type when architectures is absent (some hand-written configs).
            by_type = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
            arch = by_type.get(raw.get("model_type", "")) if not archs else None
        if arch is None:
            named = ", ".join(archs) or f"model_type={raw.get('model_type')!r}"
            raise UnsupportedArchitectureError(
                f"config.json: unsupported architecture {named}; supported: "
                f"{', '.join(SUPPORTED_ARCHITECTURES)}")
        model_type = SUPPORTED_ARCHITECTURES[arch]
        if raw.get("use_sliding_window"):
            raise UnsupportedArchitectureError("config.json: sliding-window attention is not supported")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        try:
            hidden = int(raw["hidden_size"])
            heads = int(raw["num_attention_heads"])
            cfg = cls(
                architecture=arch,
                vocab_size=int(raw["vocab_size"]),
                hidden_size=hidden,
                intermediate_size=int(raw["intermediate_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=heads,
                num_kv_heads=int(raw.get("num_key_value_heads") or heads),
                head_dim=int(raw.get("head_dim") or hidden // heads),
                max_position_embeddings=int(raw.get("max_position_embeddings", 2048)),
                rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
                rope=_parse_rope(raw),
                tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
                qkv_bias=model_type == "qwen2" or bool(raw.get("attention_bias", False)),
                o_bias=model_type == "llama" and bool(raw.get("attention_bias", False)),
                mlp_bias=bool(raw.get("mlp_bias", False)),
                bos_token_id=_optional_int(raw.get("bos_token_id")),
                eos_token_ids=_id_tuple(raw.get("eos_token_id")),
            )
        except KeyError as exc:
            raise CheckpointError(f"config.json: missing required key {exc.args[0]!r}") from None
        except (TypeError, ValueError) as exc:
            raise CheckpointError(f"config.json: malformed value ({exc})") from None
        return cfg

    @classmethod
    def from_file(cls, path: Path) -> "ModelConfig":
        try:
            raw = json.loads(Path(path).read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{path}: file not found") from None
        except json.JSONDecodeError as exc:
            raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
        if not isinstance(raw, dict):
            raise CheckpointError(f"{path}: expected a JSON object")
        return cls.from_hf_dict(raw)

    def to_hf_dict(self) -> dict[str, Any]:
        """The transformers-5 style config.json for this model."""
        rope: dict[str, Any] = {"rope_type": self.rope.rope_type, "rope_theta": self.rope.theta}
        if self.rope.rope_type != "default":
            rope["factor"] = self.rope.factor
        if self.rope.rope_type == "llama3":
            rope.update(low_freq_factor=self.rope.low_freq_factor, high_freq_factor=self.rope.high_freq_factor,
                        original_max_position_embeddings=self.rope.original_max_position_embeddings)
        out: dict[str, Any] = {
            "architectures": [self.architecture],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "max_position_embeddings": self.max_position_embeddings,
            "rms_norm_eps": self.rms_norm_eps,
            "hidden_act": "silu",
            "rope_parameters": rope,
            # transformers 4.x reads these two instead of rope_parameters
            "rope_theta": self.rope.theta,
            "rope_scaling": None if self.rope.rope_type == "default" else dict(rope),
            "tie_word_embeddings": self.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
            "torch_dtype": "float32",
        }
        if self.model_type == "llama":
            out.update(attention_bias=self.o_bias, mlp_bias=self.mlp_bias)
        return out


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    params = raw.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" not in params and params:
        # transformers 5 may nest per-layer-type parameters: {"full_attention": {...}}
        params = next(iter(params.values())) if all(isinstance(v, dict) for v in params.values()) else params
    if not isinstance(params, dict):
        params = dict(raw.get("rope_scaling") or {})
        params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"config.json: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    kwargs: dict[str, Any] = {"theta": float(params.get("rope_theta", 10000.0)), "rope_type": rope_type}
    if rope_type != "default":
        kwargs["factor"] = float(params["factor"])
    if rope_type == "llama3":
        kwargs.update(low_freq_factor=float(params["low_freq_factor"]),
                      high_freq_factor=float(params["high_freq_factor"]),
                      original_max_position_embeddings=int(params["original_max_position_embeddings"]))
    return RopeConfig(**kwargs)


def _optional_int(value: Any) -> int | None:
    return None if value is None else int(value)


def _id_tuple(value: Any) -> tuple[int, ...]:
    if value is None:
        return ()
    if isinstance(value, (list, tuple)):
        return tuple(int(v) for v in value)
    return (int(value),)
