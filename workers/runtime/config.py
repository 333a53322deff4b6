"""ModelConfig: the decoder's shape, parsed and validated from a Hugging Face ``config.json``.

Both config dialects are read: transformers 4.x (``rope_theta`` + ``rope_scaling``) and 5.x
(``rope_parameters``). A LLaVA config.json is read as its language model's (``text_config``, transformers'
defaults filled in); llava.py reads the rest of it. Anything the engine cannot run is refused here, with a
message that says what is supported, so a bad checkpoint fails at load time rather than mid-request.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from workers.runtime.errors import CheckpointError, UnsupportedArchitectureError

# architecture name in config.json -> its model_type (which decides whether q/k/v carry a bias by design)
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
}
_ARCHITECTURE_OF_TYPE = {v: k for k, v in SUPPORTED_ARCHITECTURES.items()}
# a LLaVA config.json wraps one of those as its language model (``text_config``)
LLAVA_ARCHITECTURES = ("LlavaForConditionalGeneration",)
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

    def __post_init__(self) -> None:
        # A backstop for direct construction; _parse_rope names the config.json key first.
        for name in ("theta", "factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
                raise CheckpointError(f"config.json: rope {name} must be a positive number, got {value!r}")
        if self.rope_type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            raise CheckpointError(f"config.json: rope high_freq_factor ({self.high_freq_factor!r}) must be greater "
                                  f"than low_freq_factor ({self.low_freq_factor!r})")


MAX_POSITIONS = 2**31 - 1


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
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise CheckpointError(
                    f"config.json: {_HF_KEYS.get(name, name)} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads:
            raise CheckpointError(
                f"config.json: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})")
        if self.head_dim % 2:
            raise CheckpointError(f"config.json: head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.max_position_embeddings > MAX_POSITIONS:
            raise CheckpointError(f"config.json: max_position_embeddings must be at most {MAX_POSITIONS} (positions "
                                  f"and lengths are 32-bit in the attention kernels), got "
                                  f"{self.max_position_embeddings}")
        if not 0 < self.rms_norm_eps < 1:  # a guard against a zero norm; past 1 it swamps every hidden state
            raise CheckpointError(f"config.json: rms_norm_eps must be in (0, 1), got {self.rms_norm_eps!r}")
        check_token_ids(self.eos_token_ids, "eos_token_id", "config.json", self.vocab_size)

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
    def from_hf_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """A Llama/Qwen2 config.json; for a LLaVA one, its language model's (``text_config``)."""
        if is_llava(raw):
            raw = text_config_dict(raw)
        arch = _architecture(raw)
        model_type = SUPPORTED_ARCHITECTURES[arch]
        if _flag(raw, "use_sliding_window", False):
            raise UnsupportedArchitectureError("config.json: sliding-window attention is not supported")
        act = raw.get("hidden_act", "silu")
        if act != "silu":
            raise UnsupportedArchitectureError(f"config.json: hidden_act {act!r} is not supported (only 'silu')")
        hidden = _int(raw, "hidden_size")
        heads = _int(raw, "num_attention_heads")
        attention_bias = _flag(raw, "attention_bias", False)
        return cls(
            architecture=arch,
            vocab_size=_int(raw, "vocab_size"),
            hidden_size=hidden,
            intermediate_size=_int(raw, "intermediate_size"),
            num_layers=_int(raw, "num_hidden_layers"),
            num_heads=heads,
            num_kv_heads=_int(raw, "num_key_value_heads", heads),  # absent: plain multi-head attention
            head_dim=_int(raw, "head_dim") if raw.get("head_dim") is not None else _derived_head_dim(hidden, heads),
            max_position_embeddings=_int(raw, "max_position_embeddings", 2048),
            rms_norm_eps=_number(raw, "rms_norm_eps", 1e-6),
            rope=_parse_rope(raw),
            tie_word_embeddings=_flag(raw, "tie_word_embeddings", False),
            qkv_bias=model_type == "qwen2" or attention_bias,
            o_bias=model_type == "llama" and attention_bias,
            mlp_bias=_flag(raw, "mlp_bias", False),
            bos_token_id=_optional_token_id(raw.get("bos_token_id")),
            eos_token_ids=parse_token_ids(raw.get("eos_token_id"), "eos_token_id", "config.json"),
        )

    @classmethod
    def from_file(cls, path: Path) -> ModelConfig:
        return cls.from_hf_dict(read_json_object(Path(path)))

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


# ------------------------------------------------------------------ LLaVA's config.json: its language model
def is_llava(raw: dict[str, Any]) -> bool:
    """Whether a parsed config.json describes a LLaVA checkpoint."""
    archs = raw.get("architectures")
    if isinstance(archs, list) and any(a in LLAVA_ARCHITECTURES for a in archs):
        return True
    return not archs and raw.get("model_type") == "llava"


# transformers writes a sub-config's keys that differ from the class defaults only (the Hub's LLaVA 1.5
# configs list a handful), so a missing key means the default of transformers' config class.
_TEXT_DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": {"vocab_size": 32000, "hidden_size": 4096, "intermediate_size": 11008, "num_hidden_layers": 32,
              "num_attention_heads": 32, "max_position_embeddings": 2048, "rms_norm_eps": 1e-6},
    "qwen2": {"vocab_size": 151936, "hidden_size": 4096, "intermediate_size": 22016, "num_hidden_layers": 32,
              "num_attention_heads": 32, "num_key_value_heads": 32, "max_position_embeddings": 32768,
              "rms_norm_eps": 1e-6},
}


def text_config_dict(raw: dict[str, Any]) -> dict[str, Any]:
    """A LLaVA config.json's language model, as a plain Llama/Qwen2 checkpoint's config.json would carry it."""
    text = raw.get("text_config")
    if text is None:
        text = {"model_type": "llama"}  # LlavaConfig's default
    if not isinstance(text, dict):
        raise CheckpointError(f"config.json: text_config must be an object, got {text!r:.80}")
    model_type = text.get("model_type", "llama")
    if not isinstance(model_type, str) or model_type not in _ARCHITECTURE_OF_TYPE:
        raise UnsupportedArchitectureError(
            f"config.json: LLaVA's language model text_config.model_type={model_type!r} is not supported; "
            f"supported: {', '.join(_ARCHITECTURE_OF_TYPE)}")
    out = {**_TEXT_DEFAULTS[model_type], **{k: v for k, v in text.items() if v is not None}}
    out["architectures"] = [_ARCHITECTURE_OF_TYPE[model_type]]
    out["model_type"] = model_type
    # LlavaConfig ties the head when either level says so (its __post_init__)
    out["tie_word_embeddings"] = bool(raw.get("tie_word_embeddings")) or bool(text.get("tie_word_embeddings"))
    return out


# ------------------------------------------------------------------ reading checkpoint files
def read_text(path: Path) -> str:
    """A checkpoint file's UTF-8 text; anything unreadable is a CheckpointError naming the path."""
    try:
        return path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: file not found") from None
    except NotADirectoryError:
        # some folder on the way is a file (``--model /etc/passwd``): name it
        not_folder = next((p for p in path.parents if p.exists()), path.parent)
        raise CheckpointError(f"{not_folder}: is not a folder") from None
    except IsADirectoryError:
        raise CheckpointError(f"{path}: is a folder, not a file") from None
    except UnicodeDecodeError as exc:
        raise CheckpointError(f"{path}: is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable ({exc.strerror or exc})") from None


def read_json_object(path: Path) -> dict[str, Any]:
    """A checkpoint JSON file that must hold an object (config.json, tokenizer_config.json, ...)."""
    text = read_text(path)
    try:
        raw = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: not valid JSON ({exc})") from None
    except (ValueError, RecursionError) as exc:  # an integer past Python's digit limit; nesting too deep
        raise CheckpointError(f"{path}: not JSON epd can read ({exc})") from None
    if not isinstance(raw, dict):
        raise CheckpointError(f"{path}: expected a JSON object, got {type(raw).__name__}")
    return raw


def parse_token_ids(value: Any, key: str, source: str, vocab_size: int | None = None) -> tuple[int, ...]:
    """``eos_token_id``-style values: null, one id or a list of ids, each in [0, vocab_size)."""
    if value is None:
        return ()
    ids = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in ids):
        raise CheckpointError(f"{source}: {key} must be a token id or a list of token ids, got {value!r}")
    return check_token_ids(tuple(ids), key, source, vocab_size)


def check_token_ids(ids: tuple[int, ...], key: str, source: str, vocab_size: int | None) -> tuple[int, ...]:
    limit = vocab_size if vocab_size is not None else math.inf
    bad = [i for i in ids if not 0 <= i < limit]
    if bad:
        where = f"[0, {vocab_size})" if vocab_size is not None else "non-negative"
        raise CheckpointError(f"{source}: {key} {bad[0]} is out of range (token ids must be {where})")
    return ids


# ------------------------------------------------------------------ config.json fields
_HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
            "num_kv_heads": "num_key_value_heads"}
_REQUIRED: Any = object()


def _get(raw: dict[str, Any], key: str, default: Any, where: str = "") -> Any:
    """The value at ``key``; absent or null gives ``default`` (null is how HF writes "unset")."""
    value = raw.get(key)
    if value is None:
        if default is _REQUIRED:
            raise CheckpointError(f"config.json: missing required key {where + key!r}")
        return default
    return value


def _int(raw: dict[str, Any], key: str, default: Any = _REQUIRED, *, where: str = "") -> int:
    """A positive integer. 512.0 reads as 512; 512.7, true and "512" are refused."""
    value = _get(raw, key, default, where)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise CheckpointError(f"config.json: {where}{key} must be a positive integer, got {value!r}")
    return value


def _derived_head_dim(hidden: int, heads: int) -> int:
    """What head_dim is when config.json does not say: hidden_size / num_attention_heads, which must divide."""
    if hidden % heads:
        raise CheckpointError(f"config.json: hidden_size ({hidden}) is not a multiple of num_attention_heads "
                              f"({heads}), and no head_dim says what each head holds")
    return hidden // heads


def _number(raw: dict[str, Any], key: str, default: Any = _REQUIRED, *, where: str = "") -> float:
    """A positive, finite number."""
    value = _get(raw, key, default, where)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise CheckpointError(f"config.json: {where}{key} must be a positive number, got {value!r}")
    return float(value)


def _flag(raw: dict[str, Any], key: str, default: bool) -> bool:
    value = _get(raw, key, default)
    if not isinstance(value, bool):  # "false" would be truthy
        raise CheckpointError(f"config.json: {key} must be true or false, got {value!r}")
    return value


def _optional_token_id(value: Any) -> int | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise CheckpointError(f"config.json: bos_token_id must be a token id, got {value!r}")
    return value


def _architecture(raw: dict[str, Any]) -> str:
    archs = raw.get("architectures")
    if archs is None:
        archs = []
    if not isinstance(archs, list) or not all(isinstance(a, str) for a in archs):
        raise CheckpointError(f"config.json: architectures must be a list of class names, got {archs!r}")
    arch = next((a for a in archs if a in SUPPORTED_ARCHITECTURES), None)
    if arch is None and not archs:
        # Fall back on model_type when architectures is absent (some hand-written configs).
        model_type = raw.get("model_type")
        arch = _ARCHITECTURE_OF_TYPE.get(model_type) if isinstance(model_type, str) else None
    if arch is None:
        named = ", ".join(archs) or f"model_type={raw.get('model_type')!r}"
        raise UnsupportedArchitectureError(
            f"config.json: unsupported architecture {named}; supported: {', '.join(SUPPORTED_ARCHITECTURES)} "
            f"and LlavaForConditionalGeneration over either")
    return arch


_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "linear_attention")


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    where = "rope_parameters."
    params = raw.get("rope_parameters")
    if params is not None and not isinstance(params, dict):
        raise CheckpointError(f"config.json: rope_parameters must be an object or null, got {params!r:.80}")
    if params and "rope_theta" not in params and any(k in _LAYER_TYPES for k in params):
        # transformers 5 may nest per-layer-type parameters: {"full_attention": {...}}
        bad = next((k for k, v in params.items() if not isinstance(v, dict)), None)
        if bad is not None:
            raise CheckpointError(f"config.json: rope_parameters holds per-layer-type objects, but "
                                  f"rope_parameters.{bad} is {params[bad]!r:.80}, not an object")
        layer_type, params = next(iter(params.items()))
        where = f"rope_parameters.{layer_type}."
    if not params:  # absent or empty: transformers 4 keeps rope_scaling and rope_theta at the top level
        scaling = raw.get("rope_scaling")
        if scaling is not None and not isinstance(scaling, dict):
            raise CheckpointError(f"config.json: rope_scaling must be an object or null, got {scaling!r}")
        params = dict(scaling or {})
        where = "rope_scaling."
        theta = _number(raw, "rope_theta", 10000.0)  # transformers 4 keeps theta beside rope_scaling
    else:
        theta = (_number(params, "rope_theta", where=where) if params.get("rope_theta") is not None
                 else _number(raw, "rope_theta", 10000.0))
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise UnsupportedArchitectureError(
            f"config.json: rope type {rope_type!r} is not supported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    kwargs: dict[str, Any] = {"theta": theta, "rope_type": rope_type}
    if rope_type != "default":
        kwargs["factor"] = _number(params, "factor", where=where)
    if rope_type == "llama3":
        low = _number(params, "low_freq_factor", where=where)
        high = _number(params, "high_freq_factor", where=where)
        if not high > low:
            raise CheckpointError(f"config.json: {where}high_freq_factor ({high!r}) must be greater than "
                                  f"{where}low_freq_factor ({low!r})")
        kwargs.update(low_freq_factor=low, high_freq_factor=high,
                      original_max_position_embeddings=_int(params, "original_max_position_embeddings",
                                                            where=where))
    return RopeConfig(**kwargs)
