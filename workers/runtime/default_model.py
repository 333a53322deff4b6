"""The built-in demo model: a small Llama with RANDOM weights, made deterministically from a seed.

It exists so that everything runs offline with nothing downloaded: same seed, same weights, same
tokenizer, same outputs. Its text is gibberish; it is a stand-in for a real checkpoint, which
``--model DIR`` serves instead. ``write_default_checkpoint`` writes it as an ordinary HF folder
(``transformers`` loads it as a LlamaForCausalLM) plus a CLIP-style ``vision/`` encoder, and the
engine reads it back through the same loader as any other checkpoint.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, processors, trainers

from workers.runtime.checkpoint import save_hf_weights
from workers.runtime.config import ModelConfig, RopeConfig
from workers.runtime.model import DecoderModel

DEFAULT_SEED = 0
DEFAULT_MODEL_NAME = "epd-demo-random"
FORMAT_VERSION = "2"  # bump when the default changes, so cached copies are rebuilt

BOS, EOS, IM_START, IM_END, IMAGE, PAD = (
    "<|begin_of_text|>", "<|end_of_text|>", "<|im_start|>", "<|im_end|>", "<|image|>", "<|pad|>")
SPECIAL_TOKENS = [BOS, EOS, IM_START, IM_END, IMAGE, PAD]

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] in ('image', 'image_url') %}{{ '<|image|>' }}{% endif %}"
    "{% endfor %}{% endif %}"
    "{{ '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)

# Training text for the demo tokenizer's merges. Any fixed text works; this one is about serving.
_CORPUS = """\
A serving system splits every request into three stages. The encoder turns images into embeddings.
Prefill runs the language model over the whole prompt and writes the key and value cache.
Decode generates the remaining tokens one step at a time, batching many sequences together.
Each stage runs on its own pool of workers, and operators size and scale each pool on its own.
The scheduler picks an encoder, a prefill worker and a decode worker for every request.
It reserves cache blocks on the decode worker before prefill starts, so nothing waits for memory.
The cache moves between workers layer by layer, quantised to eight or four bits when that is good enough.
Time to first token depends on prefill; time per output token depends on decode and on the batch.
When a worker stops answering, its requests are retried elsewhere and its blocks are released.
The quick brown fox jumps over the lazy dog. Pack my box with five dozen liquor jugs.
How vexingly quick daft zebras jump! The five boxing wizards jump quickly.
Hello, world. What is the capital of France? Paris is the capital of France.
Please write a short poem about the sea, the wind, the stars and the long night.
One, two, three, four, five, six, seven, eight, nine, ten, eleven, twelve.
Monday, Tuesday, Wednesday, Thursday, Friday, Saturday and Sunday are the days of the week.
January, February, March, April, May, June, July, August, September, October, November, December.
The model reads a checkpoint folder with its configuration, its weights and its tokenizer.
def main(): return sum(x * x for x in range(10))  # a line of code, for code-like text
{"model": "demo", "messages": [{"role": "user", "content": "Describe this image."}], "stream": true}
"""


def special_id(tok: HFTokenizer, token: str) -> int:
    """The id of one of the demo tokenizer's special tokens (``build_tokenizer`` adds them all)."""
    found = tok.token_to_id(token)
    if found is None:
        raise ValueError(f"the demo tokenizer has no token {token!r}")
    return found


def default_config(vocab_size: int, bos_id: int, eos_ids: tuple[int, ...]) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=vocab_size, hidden_size=512, intermediate_size=1536,
        num_layers=4, num_heads=8, num_kv_heads=4, head_dim=64, max_position_embeddings=8192,
        rms_norm_eps=1e-5, rope=RopeConfig(theta=500000.0), tie_word_embeddings=False,
        bos_token_id=bos_id, eos_token_ids=eos_ids)


def build_tokenizer(vocab_size: int = 2048) -> HFTokenizer:
    """Byte-level BPE trained on the fixed corpus above (the trainer is deterministic)."""
    tok = HFTokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(_CORPUS.splitlines(), trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)])
    return tok


def build_default_model(seed: int = DEFAULT_SEED) -> tuple[DecoderModel, HFTokenizer]:
    """The demo model's weights from ``seed``, whatever the global RNG: embeddings and LM head
    normal(0, 1), projections normal(0, 0.02), norms at 1. Untied, unit-scale embeddings make the
    output depend on the whole context (with tied 0.02-scale ones a random model just repeats its
    last token), so tests that compare token streams can tell a wrong KV cache from a right one."""
    tok = build_tokenizer()
    eos = (special_id(tok, IM_END), special_id(tok, EOS))
    cfg = default_config(tok.get_vocab_size(), special_id(tok, BOS), eos)
    model = DecoderModel(cfg, torch.float32, "cpu")
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters(), key=lambda kv: kv[0]):
            if name.endswith("layernorm.weight") or name == "norm.weight":
                param.fill_(1.0)
            elif name in ("embed_tokens.weight", "lm_head.weight"):
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.02)
    return model, tok


def write_default_checkpoint(folder: Path | str, seed: int = DEFAULT_SEED, with_vision: bool = True) -> Path:
    """Write the demo model as an HF checkpoint folder (and ``vision/``); returns the folder."""
    from workers.runtime import vision  # the encode stage's engine; imported lazily

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model, tok = build_default_model(seed)
    cfg = model.cfg
    save_hf_weights(model, folder)
    (folder / "config.json").write_text(json.dumps(cfg.to_hf_dict(), indent=2) + "\n")
    (folder / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": cfg.bos_token_id, "eos_token_id": list(cfg.eos_token_ids), "do_sample": False}, indent=2))
    tok.save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": BOS, "eos_token": IM_END, "pad_token": PAD,
        "image_token": IMAGE, "model_max_length": cfg.max_position_embeddings, "clean_up_tokenization_spaces": False,
    }, indent=2))
    (folder / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    (folder / "README.md").write_text(
        f"# {DEFAULT_MODEL_NAME}\n\nA demo model with RANDOM weights (seed {seed}), written by `epd model init`.\n"
        "It produces gibberish. It exists so that epd runs offline; serve a real checkpoint with --model DIR.\n")
    if with_vision:
        vision.save_vision(folder, vision.build_default_vision_encoder(cfg.hidden_size, seed=seed))
    return folder


def default_checkpoint_dir() -> Path:
    """Where the default model is cached: $EPD_CACHE_DIR or ~/.cache/epd, keyed by format version."""
    root = Path(os.environ.get("EPD_CACHE_DIR") or Path.home() / ".cache" / "epd")
    return root / f"{DEFAULT_MODEL_NAME}-v{FORMAT_VERSION}-seed{DEFAULT_SEED}"


def ensure_default_checkpoint() -> Path:
    """The cached default checkpoint, written first if absent (atomically, so racing writers are safe)."""
    target = default_checkpoint_dir()
    if (target / ".complete").exists():
        return target
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    write_default_checkpoint(tmp)
    (tmp / ".complete").write_text("ok\n")
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        tmp.rename(target)
    except OSError:  # another process won the race; its copy is identical
        import shutil
        shutil.rmtree(tmp, ignore_errors=True)
    return target
