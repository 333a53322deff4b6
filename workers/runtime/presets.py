"""Size presets: Llama-shaped checkpoints with RANDOM weights, made locally for benchmarks.

``1b`` is TinyLlama-1.1B's shape (hidden 2048, 22 layers, 32 heads, 4 KV heads, intermediate 5632,
vocab 32000). Nothing is downloaded: the weights are drawn from a seed on the machine that runs it
as transformers initialises a Llama (every matrix normal(0, 0.02), norms at 1), stored in bfloat16,
with the demo model's tokenizer (its ids are a subset of the preset's vocab).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch

from workers.runtime.checkpoint import save_hf_weights
from workers.runtime.config import ModelConfig, RopeConfig
from workers.runtime.errors import InvalidRequestError
from workers.runtime.model import DecoderModel

INIT_STD = 0.02  # transformers' LlamaConfig.initializer_range


@dataclass(frozen=True)
class SizePreset:
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int = 32000
    max_position_embeddings: int = 4096  # TinyLlama has 2048; 4096 lets a 2,048-token prompt decode too

    def config(self, bos_token_id: int, eos_token_ids: tuple[int, ...]) -> ModelConfig:
        return ModelConfig(
            architecture="LlamaForCausalLM", vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_layers=self.num_layers, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, head_dim=self.hidden_size // self.num_heads,
            max_position_embeddings=self.max_position_embeddings, rms_norm_eps=1e-5,
            rope=RopeConfig(theta=10000.0), bos_token_id=bos_token_id, eos_token_ids=eos_token_ids)

    @property
    def num_parameters(self) -> int:
        h, i, hd = self.hidden_size, self.intermediate_size, self.hidden_size // self.num_heads
        per_layer = h * (self.num_heads + 2 * self.num_kv_heads) * hd + self.num_heads * hd * h + 3 * h * i + 2 * h
        return self.num_layers * per_layer + 2 * self.vocab_size * h + h


PRESETS: dict[str, SizePreset] = {
    "1b": SizePreset(hidden_size=2048, num_layers=22, num_heads=32, num_kv_heads=4, intermediate_size=5632),
    # the same proportions, small enough for a test or a quick look on CPU
    "tiny": SizePreset(hidden_size=128, num_layers=2, num_heads=8, num_kv_heads=2, intermediate_size=352),
}


def write_preset_checkpoint(folder: Path | str, preset: str, seed: int = 0) -> Path:
    """Write preset ``preset`` as an HF checkpoint folder (bfloat16 weights, demo tokenizer)."""
    from workers.runtime.default_model import BOS, CHAT_TEMPLATE, EOS, IM_END, PAD, build_tokenizer, special_id

    if preset not in PRESETS:
        raise InvalidRequestError(f"unknown preset {preset!r}; one of {', '.join(PRESETS)}")
    folder = Path(folder)
    tok = build_tokenizer()
    cfg = PRESETS[preset].config(special_id(tok, BOS), (special_id(tok, IM_END), special_id(tok, EOS)))
    model = DecoderModel(cfg, torch.bfloat16, "cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * INIT_STD)
    folder.mkdir(parents=True, exist_ok=True)
    save_hf_weights(model, folder)
    hf = cfg.to_hf_dict() | {"torch_dtype": "bfloat16"}
    (folder / "config.json").write_text(json.dumps(hf, indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "do_sample": False}, indent=2))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": IM_END, "pad_token": PAD,
        "model_max_length": cfg.max_position_embeddings, "clean_up_tokenization_spaces": False}, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "README.md").write_text(
        f"# epd preset {preset}\n\nRANDOM weights (seed {seed}) in the shape of preset {preset!r}, written by "
        "`epd model init --preset`. For benchmarks: its text is gibberish.\n")
    return folder
